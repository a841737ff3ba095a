"""The run loop's checkpoints: what it adds to the trainer's, and resuming (the real torch trainer, no engines)."""
from __future__ import annotations

import asyncio

import pytest

from rlfleet.crds.specs import CheckpointSpec
from rlfleet.orchestrator.evaluation.policy import DatasetScore, EvalPoint
from rlfleet.orchestrator.run.checkpointing import (
    CheckpointRefused,
    RunCheckpoints,
    restore_summary,
    run_state,
    summary_state,
)
from rlfleet.orchestrator.run.summary import RunSummary, StepRecord
from rlfleet.trainer import checkpoint as ckpt
from rlfleet.trainer.base import build_trainer


def identity(**changes) -> ckpt.Identity:
    return ckpt.Identity(**{"run": "quickstart", "model_path": "tiny://llama", "backend": "torch", **changes})


def state_of_step(step: int, summary: RunSummary | None = None) -> dict:
    point = EvalPoint(step=0, posture="fleet", weight_version="0", engine_versions={"e0": "0"},
                      datasets={"rotate": DatasetScore(name="rotate", score=0.25, samples=4)})
    summary = summary or RunSummary(steps_planned=12)
    return run_state(run="quickstart", step=step, prompts_drawn=8 * step, eval_points=[point], eval_pending=[step],
                     summary=summary_state(summary, engines_recreated=1))


async def test_resume_falls_back_past_a_truncated_newest_checkpoint_with_a_warning(tmp_path, tiny_model):
    trainer = build_trainer("torch", tiny_model, lr=1e-2)
    events: list[str] = []
    spec = CheckpointSpec(interval_steps=3, keep=2)
    checkpoints = RunCheckpoints("quickstart", spec, tmp_path, identity(), on_event=events.append)
    for step in (3, 6):
        trainer.step = step
        held = await checkpoints.save(trainer, step, state_of_step(step))
        assert held >= 0
    await checkpoints.close()
    assert [c["step"] for c in checkpoints.written] == [3, 6]
    assert any("checkpoint step 6 written" in e for e in events)
    shard = ckpt.step_dir(tmp_path, 6) / ckpt.shard_name(0)
    shard.write_bytes(shard.read_bytes()[:1000])

    fresh = build_trainer("torch", tiny_model, lr=1e-2)
    events.clear()
    point = await RunCheckpoints("quickstart", spec, tmp_path, identity(), on_event=events.append).resume(fresh)
    assert point is not None and point.step == 3 and fresh.step == 3
    assert point.prompts_drawn == 24 and point.eval_pending == [3]
    assert point.eval_points[0].datasets["rotate"].score == 0.25 and point.eval_points[0].engine_versions == {"e0": "0"}
    warning = next(e for e in events if e.startswith("warning"))
    assert "step_00000006" in warning and "truncated" in warning
    assert "resuming from checkpoint step 3" in events[-1]


async def test_keep_removes_older_checkpoints_once_a_newer_one_is_complete(tmp_path, tiny_model):
    trainer = build_trainer("torch", tiny_model, lr=1e-2)
    checkpoints = RunCheckpoints("quickstart", CheckpointSpec(interval_steps=1, keep=2), tmp_path, identity())
    for step in (1, 2, 3):
        await checkpoints.save(trainer, step, state_of_step(step))
    await checkpoints.close()
    assert [p.name for p in ckpt.step_dirs(tmp_path)] == ["step_00000003", "step_00000002"]


async def test_a_checkpoint_of_another_run_model_or_layout_is_refused(tmp_path, tiny_model):
    trainer = build_trainer("torch", tiny_model, lr=1e-2)
    spec = CheckpointSpec(interval_steps=3)
    checkpoints = RunCheckpoints("quickstart", spec, tmp_path, identity())
    await checkpoints.save(trainer, 3, state_of_step(3))
    await checkpoints.close()
    for changes, named in (({"run": "other"}, "run"), ({"model_path": "tiny://qwen2"}, "model_path"),
                           ({"world_size": 2}, r"written by a trainer of tensor 1 x pipeline 1 x data 1 \(1 ranks\), "
                            r"this run's trainer is tensor 1 x pipeline 1 x data 2 \(2 ranks\)")):
        with pytest.raises(CheckpointRefused, match=named) as refused:
            await RunCheckpoints("quickstart", spec, tmp_path, identity(**changes)).resume(trainer)
        assert refused.value.reason == "CheckpointMismatch"
    # A fresh run (no --resume) on the same directory is refused too, and touches nothing.
    with pytest.raises(CheckpointRefused, match="--resume") as refused:
        await checkpoints.refuse_leftovers()
    assert refused.value.reason == "CheckpointsExist"
    assert [p.name for p in ckpt.step_dirs(tmp_path)] == ["step_00000003"]


async def test_no_checkpoint_starts_from_step_0_with_a_warning(tmp_path, tiny_model):
    events: list[str] = []
    trainer = build_trainer("torch", tiny_model, lr=1e-2)
    checkpoints = RunCheckpoints("quickstart", CheckpointSpec(interval_steps=3), tmp_path / "none", identity(),
                                 on_event=events.append)
    assert await checkpoints.resume(trainer) is None and trainer.step == 0
    assert "no complete checkpoint" in events[0]


def test_the_summary_so_far_round_trips():
    summary = RunSummary(steps_planned=12, engines_marked_dead=2, router_events=["rollout: restarted"])
    summary.steps = [StepRecord(1, 0.5, ["0"], 2.0, 64, engine_versions={0: "1"}, recovered_slots=[0], loss=0.125)]
    summary.checkpoints = [{"step": 3, "loop_held_seconds": 0.01, "write_seconds": 0.2}]
    state = state_of_step(3, summary)["summary"]
    again = RunSummary(steps_planned=12)
    assert restore_summary(again, state) == 1
    assert again.steps == summary.steps and again.engines_marked_dead == 2
    assert again.router_events == summary.router_events and again.checkpoints == summary.checkpoints


async def test_a_failed_write_is_a_warning_and_the_previous_checkpoint_stays(tmp_path, tiny_model):
    events: list[str] = []
    trainer = build_trainer("torch", tiny_model, lr=1e-2)
    checkpoints = RunCheckpoints("quickstart", CheckpointSpec(interval_steps=3), tmp_path, identity(),
                                 on_event=events.append)
    await checkpoints.save(trainer, 3, state_of_step(3))
    await checkpoints.wait()
    ckpt.step_dir(tmp_path, 6).write_text("a file where the directory goes")
    await checkpoints.save(trainer, 6, state_of_step(6))
    await asyncio.wait_for(checkpoints.close(), 30)
    assert any(e.startswith("warning: checkpoint step 6 failed") for e in events), events
    assert ckpt.newest_complete(tmp_path)[0].step == 3
