"""Evaluation of one run: builds the posture's evaluator and the dispatcher, and reports the points.

The run loop calls, in order:

    evaluation = RunEvaluation(name, spec, volume=..., start_eval_fleet=..., on_point=...)
    await evaluation.launch(launch_model)           # posture fleet: eval router + engines start (not waited)
    evaluation.attach(trainer=..., rollout=..., producer=..., session=..., stop_token_ids=...)
    await evaluation.after_step(0)                  # evalBeforeTrain
    ... each step, after its weight sync: await evaluation.after_step(step)
    await evaluation.finish()                       # drain: every point settled, snapshots counted
    await evaluation.close()                        # always (cancels what is left, stops the eval fleet)
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from rlfleet.crds.models import TrainingRunSpec
from rlfleet.crds.status import LastEvalStatus, now_rfc3339
from rlfleet.errors import RunError
from rlfleet.orchestrator.evaluation.api import (
    EvaluatorLoadError,
    import_checkpoint_eval_class,
    instantiate_checkpoint_eval_fn,
)
from rlfleet.orchestrator.evaluation.datasets import DatasetError, resolve_datasets
from rlfleet.orchestrator.evaluation.dispatcher import (
    EVAL_DIR,
    EvalDispatcher,
    PointEvaluator,
    SnapshotVolume,
    TrainerSnapshotExporter,
    volume_usage,
)
from rlfleet.orchestrator.evaluation.policy import EvalPoint, last_eval_fields, summarize_points

log = logging.getLogger(__name__)

# Posture fleet: starts (or attaches to) the eval fleet; returns it and its router (or None) to stop.
StartEvalFleet = Callable[[Path], Awaitable[tuple[Any, Any]]]


class EvalSetupError(RunError):
    """The eval spec cannot work (a dataset cannot be read, the evaluator class cannot be loaded)."""

    reason = "EvalInvalid"


class RunEvaluation:
    def __init__(self, run_name: str, spec: TrainingRunSpec, *, volume: Path, manifest_dir: Path | None = None,
                 start_eval_fleet: StartEvalFleet | None = None,
                 on_point: Callable[[EvalPoint], None] | None = None):
        if spec.eval is None:
            raise ValueError("the run has no eval spec")
        self.run_name = run_name
        self.spec = spec
        self.eval_spec = spec.eval
        self.volume = Path(volume)
        self.manifest_dir = manifest_dir
        self.start_eval_fleet = start_eval_fleet
        self.on_point = on_point
        self.evaluator: PointEvaluator | None = None
        self.dispatcher: EvalDispatcher | None = None
        self._router = None
        self._current_step = 0
        self.datasets: tuple = ()
        self.loop_held_s: dict[int, float] = {}  # step -> seconds the eval hook held the training loop

    @property
    def posture(self) -> str:
        return self.eval_spec.posture

    @property
    def points(self) -> list[EvalPoint]:
        return list(self.dispatcher.points) if self.dispatcher else []

    async def launch(self, launch_model: Path) -> None:
        """Check the datasets and load the user's class (EvalSetupError), start the eval fleet.

        Reading the datasets and importing the user's module run in a thread; the class is instantiated
        on the loop."""
        try:
            self.datasets = await asyncio.to_thread(resolve_datasets, self.eval_spec.datasets, self.spec.trainer,
                                                    base_dir=self.manifest_dir)
        except DatasetError as exc:
            raise EvalSetupError(f"eval dataset: {exc}") from None
        if self.posture == "fleet":
            if self.start_eval_fleet is None:
                raise EvalSetupError("posture fleet: this platform cannot start an eval fleet")
            self.evaluator, self._router = await self.start_eval_fleet(launch_model)
        elif self.posture == "external":
            from rlfleet.orchestrator.evaluation.postures.external import ExternalEvaluator

            external = self.eval_spec.external
            assert external is not None
            search = [self.manifest_dir] if self.manifest_dir else []
            try:
                cls = await asyncio.to_thread(import_checkpoint_eval_class, external.class_path, search_dirs=search)
                fn = instantiate_checkpoint_eval_fn(cls, external.class_path, external.args)
            except EvaluatorLoadError as exc:
                raise EvalSetupError(str(exc)) from None
            self.evaluator = ExternalEvaluator(fn)

    def attach(self, *, trainer, rollout, producer, session: aiohttp.ClientSession,
               stop_token_ids: Sequence[int] = ()) -> None:
        """Wire the dispatcher to the trainer (snapshots) and, for posture shared, the rollout fleet."""
        if self.posture == "shared":
            from rlfleet.orchestrator.evaluation.postures.shared import SharedEvaluator

            self.evaluator = SharedEvaluator(rollout, producer, session,
                                             pause_timeout_s=self.spec.rollout.request_timeout_seconds)
        assert self.evaluator is not None, "launch() first"
        datasets = tuple(dataclasses.replace(d, stop_token_ids=tuple(stop_token_ids)) for d in self.datasets)
        exporter = TrainerSnapshotExporter(trainer.state_for_export) if self.evaluator.uses_snapshots else None
        self.dispatcher = EvalDispatcher(
            run=self.run_name, evaluator=self.evaluator, max_in_flight=self.eval_spec.max_in_flight,
            overflow_policy=self.eval_spec.overflow_policy, keep_snapshots=self.eval_spec.keep_snapshots,
            interval_steps=self.eval_spec.interval_steps, final_step=self.spec.trainer.steps,
            before_train=self.eval_spec.eval_before_train, current_step=lambda: self._current_step,
            datasets=datasets, volume=SnapshotVolume(self.volume) if exporter else None, exporter=exporter,
            on_settled=self._settled)

    async def restore(self, points: Sequence[EvalPoint], pending: Sequence[int], *, current_step: int) -> None:
        """A resumed run: the points settled before its checkpoint, and those then pending again
        (`EvalDispatcher.resume`)."""
        assert self.dispatcher is not None, "attach() first"
        self._current_step = current_step
        await self.dispatcher.resume(points, pending, current_step=current_step)

    async def after_step(self, step: int) -> None:
        """The training loop's eval hook; how long it held the loop is kept per step (loop_held_s)."""
        assert self.dispatcher is not None, "attach() first"
        self._current_step = step
        started = time.monotonic()
        await self.dispatcher.after_step(step)
        self.loop_held_s[step] = time.monotonic() - started

    async def finish(self) -> list[EvalPoint]:
        """Wait for every pending point (the final one included)."""
        assert self.dispatcher is not None
        return await self.dispatcher.drain()

    def snapshots_left(self) -> int:
        """Eval snapshot directories on the volume now."""
        return volume_usage(self.volume / EVAL_DIR)[0]

    def summary_points(self) -> list[dict]:
        return summarize_points(self.points)

    def last_eval_status(self) -> LastEvalStatus | None:
        """status.lastEval of the TrainingRun."""
        fields = last_eval_fields(self.points)
        return None if fields is None else LastEvalStatus(**fields, time=now_rfc3339())

    async def close(self) -> None:
        try:
            if self.dispatcher is not None:
                await self.dispatcher.cancel()
        finally:
            try:
                close = getattr(self.evaluator, "close", None)
                if close is not None:
                    await close()
            finally:
                if self._router is not None:
                    await self._router.stop()

    def _settled(self, point: EvalPoint) -> None:
        if self.on_point is not None:
            self.on_point(point)
