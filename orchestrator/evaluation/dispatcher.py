"""The eval dispatcher: the I/O edge of the evaluation policy (eval_policy.py).

The training loop calls `after_step(step)` after each weight sync and `drain()` at the end. For each
eval step the dispatcher:

1. applies maxInFlight and the overflow policy: `skip` records the point as skipped `busy` at once,
   `backpressure` (and the final step, always) waits for the oldest pending point;
2. for postures that evaluate a snapshot, takes the weights off the device (the only part the training
   loop waits for) and writes `<volume>/eval/step_<N>/` in a thread beside training, `.complete` last;
3. runs the point as a task: wait for the export, check the snapshot (`ckpt_missing`), wait for a free
   evaluation slot (as many as the evaluator can take at once), evaluate;
4. settles it, whatever happened: a result, an `EvalSkip` reason, `crashed` for any other exception,
   `cancelled` on shutdown; records it at its intended step (summary, metrics, callback) and retires
   its snapshot exactly once. The `keepSnapshots` newest consumed snapshots stay on the volume.

Nothing a point does can raise into the training loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rlfleet.observability import metrics
from rlfleet.orchestrator.evaluation.api import EvalOutcome, EvalRequest, EvalSkip
from rlfleet.orchestrator.evaluation.policy import (
    UNUSABLE_SNAPSHOT_REASONS,
    Admission,
    EvalPoint,
    SnapshotLedger,
    admit,
    is_eval_step,
)
from rlfleet.snapshot.format import SnapshotInvalid

log = logging.getLogger(__name__)

EVAL_DIR = "eval"


class PointEvaluator(Protocol):
    """Evaluates one point: a posture (shared, fleet, external)."""

    posture: str
    concurrency: int  # points it can evaluate at once
    uses_snapshots: bool  # needs `<volume>/eval/step_<N>/` (fleet, external) or not (shared)

    async def evaluate(self, request: EvalRequest) -> EvalOutcome: ...


class SnapshotExporter(Protocol):
    async def start(self, step: int, directory: Path) -> tuple[float, asyncio.Future[float]]:
        """Capture the weights (awaited by the training loop); return the seconds that took and a
        future of the write (its result: the seconds writing took)."""


def eval_snapshot_dir(volume: Path, step: int) -> Path:
    return Path(volume) / EVAL_DIR / f"step_{step}"


class SnapshotVolume:
    """Eval snapshots on the run's volume: `<volume>/eval/step_<N>/` (the I/O of snapshot retirement)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def directory(self, step: int) -> Path:
        return eval_snapshot_dir(self.root, step)

    async def remove(self, directory: str) -> None:
        await asyncio.to_thread(shutil.rmtree, directory, True)

    async def usage(self) -> tuple[int, int]:
        return await asyncio.to_thread(volume_usage, self.root / EVAL_DIR)


async def check_snapshot(directory: Path, step: int) -> None:
    """Marker, manifest, headers and checksums, in a thread; raises SnapshotInvalid."""
    from rlfleet.snapshot.format import validate_snapshot

    await asyncio.to_thread(validate_snapshot, directory, expected_step=step)


def volume_usage(root: Path) -> tuple[int, int]:
    """(snapshot directories, bytes) under `root`."""
    dirs = 0
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(root):
            if entry.is_dir(follow_symlinks=False):
                dirs += 1
                for base, _, files in os.walk(entry.path):
                    for name in files:
                        with contextlib.suppress(OSError):
                            total += os.lstat(os.path.join(base, name)).st_size
    return dirs, total


@dataclass
class _Pending:
    step: int
    task: asyncio.Task


class EvalDispatcher:
    def __init__(self, *, run: str, evaluator: PointEvaluator, max_in_flight: int, overflow_policy: str,
                 keep_snapshots: int, interval_steps: int, final_step: int, before_train: bool,
                 current_step: Callable[[], int], datasets: tuple = (), volume: SnapshotVolume | None = None,
                 exporter: SnapshotExporter | None = None, on_settled: Callable[[EvalPoint], None] | None = None,
                 check_snapshot: Callable[[Path, int], Awaitable[None]] = check_snapshot):
        if evaluator.uses_snapshots and (volume is None or exporter is None):
            raise ValueError(f"posture {evaluator.posture} evaluates snapshots: it needs a volume and an exporter")
        admit(0, max_in_flight=max_in_flight, overflow_policy=overflow_policy)  # validates both
        self.run = run
        self.evaluator = evaluator
        self.max_in_flight = max_in_flight
        self.overflow_policy = overflow_policy
        self.interval_steps = interval_steps
        self.final_step = final_step
        self.before_train = before_train
        self.datasets = datasets
        self.volume = volume
        self.exporter = exporter
        self.ledger = SnapshotLedger(keep=keep_snapshots)
        self.points: list[EvalPoint] = []
        self.backpressure_wait_s = 0.0  # total time the training loop waited on full slots
        self._current_step = current_step
        self._on_settled = on_settled
        self._check_snapshot = check_snapshot
        self._pending: list[_Pending] = []
        self._slots = asyncio.Semaphore(max(1, min(max_in_flight, evaluator.concurrency)))

    # --- what the training loop calls -----------------------------------------------------------------

    def is_eval_step(self, step: int) -> bool:
        return is_eval_step(step, interval=self.interval_steps, final_step=self.final_step,
                            before_train=self.before_train)

    async def after_step(self, step: int) -> None:
        """Dispatch the point of `step` if it is an eval step (the final step is forced)."""
        if self.is_eval_step(step):
            await self.dispatch(step, force=step == self.final_step)

    async def dispatch(self, step: int, *, force: bool = False) -> None:
        loop = asyncio.get_running_loop()
        self._reap()
        while True:
            decision = admit(len(self._pending), max_in_flight=self.max_in_flight,
                             overflow_policy=self.overflow_policy, force=force)
            if decision is Admission.START:
                break
            if decision is Admission.SKIP_BUSY:
                busy = ", ".join(str(p.step) for p in self._pending)
                await self._record(EvalPoint(step=step, posture=self.evaluator.posture, skipped="busy",
                                             detail=f"{len(self._pending)} points pending (steps {busy})", lag_steps=0))
                return
            waited_from = loop.time()
            await asyncio.wait([self._pending[0].task])
            self._reap()
            waited = loop.time() - waited_from
            self.backpressure_wait_s += waited
            metrics.EVAL_BACKPRESSURE_WAIT.labels(run=self.run).observe(waited)

        directory: Path | None = None
        write: asyncio.Future[float] | None = None
        dispatched_at = loop.time()
        if self.evaluator.uses_snapshots:
            assert self.volume is not None and self.exporter is not None
            directory = self.volume.directory(step)
            self.ledger.take(step, str(directory))
            try:
                blocked, write = await self.exporter.start(step, directory)
            except Exception as exc:
                log.exception("run %s: taking the weights of step %d for eval failed", self.run, step)
                await self._retire(step, usable=False)
                await self._record(EvalPoint(step=step, posture=self.evaluator.posture, skipped="export_failed",
                                             detail=f"{type(exc).__name__}: {exc}", lag_steps=0))
                return
            metrics.EVAL_EXPORT_BLOCKING.labels(run=self.run).observe(blocked)
        task = asyncio.create_task(self._run_point(step, directory, write, dispatched_at), name=f"eval-step-{step}")
        self._pending.append(_Pending(step, task))
        self._gauge()

    async def drain(self) -> list[EvalPoint]:
        """Wait until every pending point has settled (shutdown); returns all points so far."""
        while self._pending:
            await asyncio.gather(*(p.task for p in self._pending), return_exceptions=True)
            self._reap()
        if not self.ledger.balanced:
            log.error("run %s: eval snapshots not retired after drain: %s", self.run, self.ledger.owned)
        return self.points

    async def cancel(self) -> None:
        """Abandon pending points (the run is failing): each settles as `cancelled`, snapshots retired."""
        for pending in self._pending:
            pending.task.cancel()
        await self.drain()

    async def resume(self, points: Sequence[EvalPoint], pending: Sequence[int], *, current_step: int) -> None:
        """A resumed run: the points settled before its checkpoint are taken as they were; those then
        pending are dispatched again. A pending point of the checkpoint's own step (`current_step`) is
        evaluated on the trainer's restored weights; one of an earlier step settles as skipped
        `ckpt_missing` (the checkpoint holds only its own step's weights)."""
        self.points.extend(points)
        for step in sorted(set(pending)):
            if step == current_step:
                await self.dispatch(step, force=step == self.final_step)
            else:
                await self._record(EvalPoint(
                    step=step, posture=self.evaluator.posture, skipped="ckpt_missing",
                    detail=f"pending when the trainer stopped; the checkpoint it resumed from holds the weights "
                           f"of step {current_step}, not {step}", lag_steps=max(0, current_step - step)))

    @property
    def pending_steps(self) -> list[int]:
        """Steps whose points have not settled (a settled one stays in `_pending` until the next reap)."""
        return [p.step for p in self._pending if not p.task.done()]

    # --- one point --------------------------------------------------------------------------------------

    async def _run_point(self, step: int, directory: Path | None, write: asyncio.Future[float] | None,
                         dispatched_at: float) -> None:
        loop = asyncio.get_running_loop()
        point = EvalPoint(step=step, posture=self.evaluator.posture)
        started: float | None = None
        try:
            if write is not None:
                try:
                    point.export_seconds = await asyncio.shield(write)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    raise EvalSkip("export_failed", f"{type(exc).__name__}: {exc}") from exc
                metrics.EVAL_EXPORT_DURATION.labels(run=self.run).observe(point.export_seconds)
            if directory is not None:
                try:
                    await self._check_snapshot(directory, step)
                except SnapshotInvalid as exc:
                    raise EvalSkip("ckpt_missing", str(exc)) from exc
            async with self._slots:
                started = loop.time()
                point.queued_seconds = started - dispatched_at
                request = EvalRequest(run=self.run, step=step, weight_version=str(step), datasets=self.datasets,
                                      checkpoint_dir=directory)
                outcome = await self.evaluator.evaluate(request)
            point.weight_version = outcome.weight_version
            point.datasets = dict(outcome.datasets)
            point.engine_versions = dict(outcome.engine_versions)
        except EvalSkip as skip:
            point.skipped, point.detail = skip.reason, skip.detail
            point.engine_versions = dict(skip.engine_versions)
            log.warning("run %s: eval point %d skipped (%s) %s", self.run, step, skip.reason, skip.detail)
        except asyncio.CancelledError:
            point.skipped, point.detail = "cancelled", "the run stopped before the point settled"
            raise
        except Exception as exc:
            log.exception("run %s: eval point %d crashed", self.run, step)
            point.skipped, point.detail = "crashed", f"{type(exc).__name__}: {exc}"
        finally:
            if started is not None:
                point.seconds = loop.time() - started
            point.lag_steps = max(0, self._current_step() - step)
            if directory is not None:
                # Never delete a directory a writer thread is still filling. The write is unfinished only
                # when this point was cancelled while waiting for it, so the task ends cancelled anyway:
                # wait the writer out, through a further cancel too; the write's own failure is not ours.
                while write is not None and not write.done():
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await asyncio.shield(write)
                await self._retire(step, usable=point.skipped not in UNUSABLE_SNAPSHOT_REASONS)
            await self._record(point)

    # --- bookkeeping ------------------------------------------------------------------------------------

    def _reap(self) -> None:
        self._pending = [p for p in self._pending if not p.task.done()]
        self._gauge()

    def _gauge(self) -> None:
        metrics.EVAL_IN_FLIGHT.labels(run=self.run, posture=self.evaluator.posture).set(len(self._pending))

    async def _retire(self, step: int, *, usable: bool) -> None:
        doomed = self.ledger.retire(step, usable=usable)
        assert self.volume is not None
        for path in doomed:
            await self.volume.remove(path)
            log.info("run %s: eval snapshot %s deleted", self.run, path)
        count, size = await self.volume.usage()
        metrics.EVAL_SNAPSHOTS.labels(run=self.run).set(count)
        metrics.EVAL_SNAPSHOT_BYTES.labels(run=self.run).set(size)

    async def _record(self, point: EvalPoint) -> None:
        self.points.append(point)
        posture = self.evaluator.posture
        outcome = "skipped" if point.skipped else "evaluated"
        metrics.EVAL_POINTS.labels(run=self.run, posture=posture, outcome=outcome).inc()
        if point.seconds is not None:
            metrics.EVAL_DURATION.labels(run=self.run, posture=posture, outcome=outcome).observe(point.seconds)
        if point.skipped:
            metrics.EVAL_SKIPPED.labels(run=self.run, reason=point.skipped).inc()
        else:
            newest = max((p.step for p in self.points if not p.skipped), default=point.step)
            if point.step >= newest:
                metrics.EVAL_SCORE_STEP.labels(run=self.run).set(point.step)
                for name, score in point.datasets.items():
                    metrics.EVAL_SCORE.labels(run=self.run, dataset=name).set(score.score)
                    if score.response_length_mean is not None:
                        metrics.EVAL_RESPONSE_LENGTH.labels(run=self.run, dataset=name).set(score.response_length_mean)
                    if score.truncated_ratio is not None:
                        metrics.EVAL_TRUNCATED_RATIO.labels(run=self.run, dataset=name).set(score.truncated_ratio)
            if point.mixed_version_ratio is not None:
                metrics.EVAL_MIXED_VERSION_RATIO.labels(run=self.run).set(point.mixed_version_ratio)
        if point.lag_steps is not None:
            metrics.EVAL_LAG_STEPS.labels(run=self.run).set(point.lag_steps)
        log.info("run %s: eval point %d %s", self.run, point.step,
                 f"skipped {point.skipped}" if point.skipped else f"scores {point.scores}")
        if self._on_settled is not None:
            try:
                self._on_settled(point)
            except Exception:
                log.exception("run %s: eval settle callback failed", self.run)


class TrainerSnapshotExporter:
    """Takes a trainer's weights off the device on the loop's behalf, writes the snapshot in a thread."""

    def __init__(self, capture: Callable[[], Any], write: Callable[[Any, Path], object] | None = None):
        self._capture = capture
        if write is None:
            from rlfleet.snapshot.writer import write_hf_snapshot

            write = write_hf_snapshot
        self._write = write

    async def start(self, step: int, directory: Path) -> tuple[float, asyncio.Future[float]]:
        started = time.monotonic()
        state = await asyncio.to_thread(self._capture)
        blocked = time.monotonic() - started
        if getattr(state, "step", step) != step:
            import dataclasses

            state = dataclasses.replace(state, step=step)

        def write() -> float:
            began = time.monotonic()
            self._write(state, directory)
            return time.monotonic() - began

        return blocked, asyncio.create_task(asyncio.to_thread(write))
