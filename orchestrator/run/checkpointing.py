"""The run loop's checkpoints (spec.checkpoint): when to write, what the run adds, and resuming.

    checkpoints = RunCheckpoints(name, spec.checkpoint, root, identity, on_event=...)
    state = await checkpoints.resume(trainer)      # --resume: the trainer restored; the run's state (or None)
    await checkpoints.refuse_leftovers()           # a fresh run: checkpoints of an earlier one are refused
    ... after step N's weight sync, N % intervalSteps == 0:
    await checkpoints.save(trainer, N, run_state)  # holds the loop only to copy the state off the device
    await checkpoints.close()                      # the write in flight finishes (the run's end)

The trainer's part (shards, marker, validation, fallback) is trainer/checkpoint.py; this adds the run's
state: the prompt iterator's position, the eval dispatcher's points, the summary so far. A trainer of
several ranks (rank 0's LeadingTrainer) has every rank copy its state and write its own shard
(trainer/rank_checkpoints.py); rank 0 writes the marker once every rank reported its shard.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlfleet.crds.specs import CheckpointSpec
from rlfleet.errors import RunError
from rlfleet.observability import metrics
from rlfleet.orchestrator.evaluation.policy import DatasetScore, EvalPoint
from rlfleet.orchestrator.run.summary import RunEvent, RunSummary, StepRecord
from rlfleet.trainer import checkpoint as ckpt
from rlfleet.trainer.ranks import LeadingTrainer

log = logging.getLogger(__name__)

# A trainer state up to this size (the tiny model's is ~1 MB) is copied off the device on the loop
# itself: the copy takes about a millisecond, the hand-off to a thread and back several on a busy host.
INLINE_COPY_BYTES = 16 << 20


class CheckpointRefused(RunError):
    """A checkpoint cannot be resumed from (another run, model or layout), or a fresh run would mix
    its checkpoints with an earlier run's."""

    reason = "CheckpointMismatch"


@dataclasses.dataclass
class ResumePoint:
    """What a resumed run starts from: the checkpoint's step, weight version and run state."""

    step: int
    weight_version: str
    directory: Path
    prompts_drawn: int
    eval_points: list[EvalPoint]
    eval_pending: list[int]
    summary: dict[str, Any]


# --- the run's state, as JSON ------------------------------------------------------------------------


def point_to_dict(point: EvalPoint) -> dict[str, Any]:
    return dataclasses.asdict(point)


def point_from_dict(data: dict[str, Any]) -> EvalPoint:
    datasets = {name: DatasetScore(**score) for name, score in data.get("datasets", {}).items()}
    return EvalPoint(**{**data, "datasets": datasets})


def summary_state(summary: RunSummary, engines_recreated: int) -> dict[str, Any]:
    return {
        "steps": [dataclasses.asdict(s) for s in summary.steps],
        "engines_marked_dead": summary.engines_marked_dead,
        "engines_recreated": engines_recreated,
        "router_events": list(summary.router_events),
        "resumed_from": list(summary.resumed_from),
        "checkpoints": list(summary.checkpoints),
        "events": [dataclasses.asdict(e) for e in summary.events],
    }


def restore_summary(summary: RunSummary, state: dict[str, Any]) -> int:
    """Put the summary so far back; returns the engines recreated before the checkpoint."""
    summary.steps = [StepRecord(**{**s, "engine_versions": {int(k): v for k, v in s["engine_versions"].items()}})
                     for s in state.get("steps", [])]
    summary.engines_marked_dead = int(state.get("engines_marked_dead", 0))
    summary.router_events = list(state.get("router_events", []))
    summary.resumed_from = list(state.get("resumed_from", []))
    summary.checkpoints = list(state.get("checkpoints", []))
    summary.events = [RunEvent(**e) for e in state.get("events", [])]
    return int(state.get("engines_recreated", 0))


def run_state(*, run: str, step: int, prompts_drawn: int, eval_points: list[EvalPoint], eval_pending: list[int],
              summary: dict[str, Any]) -> dict[str, Any]:
    """The run's part of a checkpoint, as plain JSON (a copy: later changes do not reach it)."""
    state = {"run": run, "step": step, "prompts_drawn": prompts_drawn,
             "eval": {"points": [point_to_dict(p) for p in eval_points], "pending": list(eval_pending)},
             "summary": summary}
    return json.loads(json.dumps(state))


def resume_point(info: ckpt.CheckpointInfo, state: dict[str, Any]) -> ResumePoint:
    evaluation = state.get("eval", {})
    return ResumePoint(step=info.step, weight_version=info.weight_version, directory=info.directory,
                       prompts_drawn=int(state.get("prompts_drawn", 0)),
                       eval_points=[point_from_dict(p) for p in evaluation.get("points", [])],
                       eval_pending=[int(s) for s in evaluation.get("pending", [])],
                       summary=state.get("summary", {}))


# --- the I/O --------------------------------------------------------------------------------------------


class RunCheckpoints:
    def __init__(self, run: str, spec: CheckpointSpec, root: Path, identity: ckpt.Identity, *,
                 on_event: Callable[[str], None] = lambda message: None):
        self.run = run
        self.spec = spec
        self.root = Path(root)
        self.identity = identity
        self.on_event = on_event
        self.written: list[dict[str, Any]] = []  # step, loop_held_seconds, write_seconds of this process
        self._write: asyncio.Task | None = None
        self._state_bytes: int | None = None  # of the last capture: a small state is copied on the loop

    def is_checkpoint_step(self, step: int) -> bool:
        return step % self.spec.interval_steps == 0

    async def refuse_leftovers(self) -> None:
        """A fresh run (no --resume) on a directory that holds checkpoints: refused, nothing is touched."""
        found = await asyncio.to_thread(ckpt.step_dirs, self.root)
        if found:
            raise CheckpointRefused(
                f"{self.root} holds checkpoints ({', '.join(p.name for p in found[:3])}) of an earlier run: "
                "resume from them with --resume, or remove them (or set spec.checkpoint.path) to start again",
                reason="CheckpointsExist")

    async def resume(self, trainer) -> ResumePoint | None:
        """Restore `trainer` from the newest complete checkpoint (falling back past broken ones, with a
        warning each); None (a warning) when there is none. CheckpointRefused for another run's."""
        info, skipped = await asyncio.to_thread(ckpt.newest_complete, self.root)
        for why in skipped:
            log.warning("run %s: checkpoint skipped: %s", self.run, why)
            self.on_event(f"warning: checkpoint skipped: {why}")
        if info is None:
            self.on_event(f"warning: no complete checkpoint under {self.root}: starting from step 0")
            return None
        try:
            ckpt.check_identity(info, self.identity)
            if isinstance(trainer, LeadingTrainer):  # every rank its own shard
                await asyncio.to_thread(trainer.restore_checkpoint, info)
            else:
                state = await asyncio.to_thread(ckpt.load_shard, info, 0)
                await asyncio.to_thread(ckpt.restore_state, trainer, state)
            point = resume_point(info, await asyncio.to_thread(info.run_state))
        except ckpt.CheckpointMismatch as exc:
            raise CheckpointRefused(str(exc)) from None
        metrics.CHECKPOINT_STEP.labels(run=self.run).set(info.step)
        self.on_event(f"resuming from checkpoint step {info.step} ({info.directory})")
        return point

    async def save(self, trainer, step: int, state: dict[str, Any] | Callable[[float], dict[str, Any]]) -> float:
        """Copy the trainer's state off the device (awaited: the seconds it held the loop are returned
        and measured) and write the checkpoint in a thread. One write at a time: a write still going
        from the previous checkpoint is waited for first. `state` is the run's state, or a function of
        the seconds the copy held the loop that returns it (so a checkpoint can record its own)."""
        started = time.monotonic()  # a previous write still going holds the loop too: counted
        await self.wait()
        capture: Callable[[], dict[str, Any]] = functools.partial(ckpt.capture_state, trainer)
        if isinstance(trainer, LeadingTrainer):  # every rank copies its state, then writes its shard
            directory = ckpt.step_dir(self.root, step)
            if directory.exists():  # a leftover of a killed writer: gone before any rank writes into it
                await asyncio.to_thread(ckpt.prepare_step_dir, self.root, step)
            capture = functools.partial(trainer.capture_checkpoint, directory)
        if self._state_bytes is not None and self._state_bytes <= INLINE_COPY_BYTES:
            captured = capture()  # a few ms: cheaper than the hop to a thread and back
        else:
            captured = await asyncio.to_thread(capture)
        held = time.monotonic() - started
        self._state_bytes = ckpt.state_bytes(captured)
        if callable(state):
            state = state(held)
        metrics.CHECKPOINT_LOOP_HELD.labels(run=self.run).observe(held)
        write = (functools.partial(self._write_ranks, trainer) if isinstance(trainer, LeadingTrainer)
                 else self._write_one)
        self._write = asyncio.create_task(self._written(step, captured, state, held, write),
                                          name=f"checkpoint-{step}")
        return held

    def _write_one(self, step: int, captured: dict[str, Any], state: dict[str, Any]) -> ckpt.CheckpointInfo:
        return ckpt.write_checkpoint(self.root, identity=self.identity, step=step, weight_version=str(step),
                                     state=captured, run_state=state)

    def _write_ranks(self, trainer: LeadingTrainer, step: int, captured: dict[str, Any],
                     state: dict[str, Any]) -> ckpt.CheckpointInfo:
        """Rank 0's shard, every rank's report, then (all written) meta, run state and the marker."""
        directory = ckpt.step_dir(self.root, step)
        reports = trainer.write_checkpoint_shard(directory, captured)
        ckpt.check_shard_reports(step, reports, self.identity.world_size)
        return ckpt.finalize(directory, identity=self.identity, step=step, weight_version=str(step), run_state=state)

    async def _written(self, step: int, captured: dict[str, Any], state: dict[str, Any], held: float,
                       write: Callable[[int, dict[str, Any], dict[str, Any]], ckpt.CheckpointInfo]) -> None:
        started = time.monotonic()
        try:
            info = await asyncio.to_thread(write, step, captured, state)
            await asyncio.to_thread(ckpt.prune, self.root, self.spec.keep)
        except Exception as exc:  # a lost checkpoint is a warning; the previous one is still there
            log.exception("run %s: checkpoint of step %d failed", self.run, step)
            metrics.CHECKPOINTS.labels(run=self.run, outcome="failed").inc()
            self.on_event(f"warning: checkpoint step {step} failed: {type(exc).__name__}: {exc}")
            return
        seconds = time.monotonic() - started
        metrics.CHECKPOINT_WRITE_DURATION.labels(run=self.run).observe(seconds)
        metrics.CHECKPOINTS.labels(run=self.run, outcome="written").inc()
        metrics.CHECKPOINT_STEP.labels(run=self.run).set(step)
        self.written.append({"step": step, "loop_held_seconds": round(held, 6), "write_seconds": round(seconds, 6)})
        self.on_event(f"checkpoint step {step} written to {info.directory} "
                      f"(held the loop {held:.3f} s, written in {seconds:.2f} s)")

    async def wait(self) -> None:
        """The write in flight, if any, has finished (success or a warning)."""
        if self._write is not None:
            await asyncio.shield(self._write)
            self._write = None

    async def close(self) -> None:
        """At the run's end, on any path: a write in flight finishes (a cancel does not cut it short)."""
        task, self._write = self._write, None
        while task is not None and not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                if task.done():
                    raise
                continue
