"""EvalDispatcher on a virtual clock (looptime): admission, forced final point, concurrency, settling,
single ownership of snapshots.

The exporter, the volume and the evaluator stand for I/O only (writing files, deleting them, talking
to engines); what is under test is the dispatcher's scheduling and bookkeeping.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from rlfleet.orchestrator.evaluation.api import EvalOutcome, EvalSkip
from rlfleet.orchestrator.evaluation.dispatcher import EvalDispatcher
from rlfleet.orchestrator.evaluation.policy import DatasetScore
from rlfleet.snapshot.format import SnapshotInvalid

pytestmark = pytest.mark.looptime


class MemoryVolume:
    def __init__(self):
        self.dirs: set[str] = set()
        self.removed: list[str] = []

    def directory(self, step: int) -> Path:
        return Path(f"/volume/eval/step_{step}")

    async def remove(self, directory: str) -> None:
        self.dirs.discard(directory)
        self.removed.append(directory)

    async def usage(self) -> tuple[int, int]:
        return len(self.dirs), 100 * len(self.dirs)


class MemoryExporter:
    """Capture takes 0.05 s of the loop; the write takes write_s beside it."""

    def __init__(self, volume: MemoryVolume, write_s: float = 1.0, fail_capture: set[int] = frozenset(),
                 fail_write: set[int] = frozenset()):
        self.volume = volume
        self.write_s = write_s
        self.fail_capture = fail_capture
        self.fail_write = fail_write

    async def start(self, step: int, directory: Path):
        await asyncio.sleep(0.05)
        if step in self.fail_capture:
            raise RuntimeError("device lost")
        self.volume.dirs.add(str(directory))

        async def write() -> float:
            await asyncio.sleep(self.write_s)
            if step in self.fail_write:
                raise OSError(28, "No space left on device")
            return self.write_s

        return 0.05, asyncio.ensure_future(write())


class ScriptedEvaluator:
    posture = "external"
    uses_snapshots = True

    def __init__(self, seconds: float = 10.0, concurrency: int = 1, raises: dict[int, BaseException] | None = None):
        self.seconds = seconds
        self.concurrency = concurrency
        self.raises = raises or {}
        self.running = 0
        self.most_running = 0
        self.evaluated: list[int] = []

    async def evaluate(self, request):
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await asyncio.sleep(self.seconds)
            if request.step in self.raises:
                raise self.raises[request.step]
            self.evaluated.append(request.step)
            return EvalOutcome(weight_version=request.weight_version,
                               datasets={"d": DatasetScore("d", request.step / 100, samples=1,
                                                           mixed_version_ratio=0.0)})
        finally:
            self.running -= 1


def make(evaluator, *, steps=6, interval=1, max_in_flight=2, policy="backpressure", keep=2, before_train=False,
         exporter_kwargs=None, check=None, run="unit"):
    volume = MemoryVolume()
    exporter = MemoryExporter(volume, **(exporter_kwargs or {}))
    state = {"step": 0}

    async def ok(directory, step):
        return None

    dispatcher = EvalDispatcher(
        run=run, evaluator=evaluator, max_in_flight=max_in_flight, overflow_policy=policy, keep_snapshots=keep,
        interval_steps=interval, final_step=steps, before_train=before_train, current_step=lambda: state["step"],
        volume=volume, exporter=exporter, check_snapshot=check or ok)
    return dispatcher, volume, state


async def train(dispatcher, state, steps: int, step_s: float = 1.0) -> list[float]:
    """A training loop: each step takes step_s, then the eval hook; returns when each step ended."""
    loop = asyncio.get_running_loop()
    ends = []
    for step in range(1, steps + 1):
        await asyncio.sleep(step_s)
        state["step"] = step
        await dispatcher.after_step(step)
        ends.append(loop.time())
    await dispatcher.drain()
    return ends


def skipped(name: str, reason: str) -> float:
    return REGISTRY.get_sample_value("rlfleet_eval_skipped_total", {"run": name, "reason": reason}) or 0.0


async def test_backpressure_makes_training_wait_and_skips_nothing():
    evaluator = ScriptedEvaluator(seconds=10)
    dispatcher, volume, state = make(evaluator, steps=6, max_in_flight=2)
    ends = await train(dispatcher, state, 6)
    assert [p.step for p in dispatcher.points] == [1, 2, 3, 4, 5, 6]
    assert all(p.skipped is None for p in dispatcher.points)
    assert evaluator.evaluated == [1, 2, 3, 4, 5, 6]
    # Two points fit; from step 3 on the loop waits for the oldest point (10 s each, one at a time).
    assert dispatcher.backpressure_wait_s > 20
    assert ends[-1] > 6 * 1.0 + 20
    assert evaluator.most_running == 1


async def test_skip_policy_records_busy_points_and_still_evaluates_the_final_step():
    evaluator = ScriptedEvaluator(seconds=10)
    dispatcher, volume, state = make(evaluator, steps=6, max_in_flight=1, policy="skip", run="unit-skip")
    before = skipped("unit-skip", "busy")
    ends = await train(dispatcher, state, 6)
    by_step = {p.step: p.skipped for p in dispatcher.points}
    assert by_step[1] is None and by_step[6] is None  # the final step waits instead of being skipped
    busy = [s for s, reason in by_step.items() if reason == "busy"]
    assert busy and set(busy) <= {2, 3, 4, 5}
    assert skipped("unit-skip", "busy") - before == len(busy)
    assert dispatcher.backpressure_wait_s > 0  # only the forced final point waited
    assert ends[4] == pytest.approx(5 * 1.0 + 0.05)  # steps 1-5 never waited: one capture, four busy skips
    assert not any(f"/volume/eval/step_{s}" in volume.removed for s in busy)  # busy points export nothing
    assert dispatcher.ledger.balanced


async def test_points_evaluate_concurrently_up_to_what_the_evaluator_allows():
    for allowed, expected in ((1, 1), (2, 2), (8, 3)):
        evaluator = ScriptedEvaluator(seconds=10, concurrency=allowed)
        dispatcher, _, state = make(evaluator, steps=6, max_in_flight=3)
        await train(dispatcher, state, 6, step_s=0.5)
        assert evaluator.most_running == expected, allowed
        assert sorted(evaluator.evaluated) == [1, 2, 3, 4, 5, 6]


async def test_every_settled_point_retires_exactly_one_snapshot_whatever_happened():
    evaluator = ScriptedEvaluator(seconds=2,
                                  raises={2: RuntimeError("judge crashed"),
                                          3: EvalSkip("judge_down", "502", engine_versions={"judge": "2"})})

    async def check(directory, step):
        if step == 5:
            raise SnapshotInvalid(str(directory), "no .complete marker")

    dispatcher, volume, state = make(evaluator, steps=7, max_in_flight=2, keep=2, check=check,
                                     exporter_kwargs={"fail_write": {4}, "fail_capture": {6}}, run="unit-own")
    await train(dispatcher, state, 7, step_s=5)
    reasons = {p.step: p.skipped for p in dispatcher.points}
    assert reasons == {1: None, 2: "crashed", 3: "judge_down", 4: "export_failed", 5: "ckpt_missing",
                       6: "export_failed", 7: None}
    crashed = next(p for p in dispatcher.points if p.step == 2)
    assert "judge crashed" in crashed.detail
    assert next(p for p in dispatcher.points if p.step == 3).engine_versions == {"judge": "2"}
    assert dispatcher.ledger.balanced and dispatcher.ledger.taken == 7
    # Unusable snapshots (failed export, failed check) went at once; of the rest the 2 newest stay.
    assert volume.dirs == {"/volume/eval/step_3", "/volume/eval/step_7"}
    assert sorted(volume.removed) == sorted(f"/volume/eval/step_{s}" for s in (1, 2, 4, 5, 6))
    assert len(volume.removed) == len(set(volume.removed))  # each deleted once


async def test_lag_is_counted_in_training_steps_taken_by_the_time_a_point_settles():
    evaluator = ScriptedEvaluator(seconds=3.5)
    dispatcher, _, state = make(evaluator, steps=4, max_in_flight=4)
    await train(dispatcher, state, 4, step_s=1)
    lags = {p.step: p.lag_steps for p in dispatcher.points}
    assert lags[1] == 3 and lags[4] == 0
    assert all(p.seconds == pytest.approx(3.5) for p in dispatcher.points)
    assert all(p.export_seconds == pytest.approx(1.0) for p in dispatcher.points)


async def test_the_initial_model_is_a_point_when_evaluated_before_training():
    evaluator = ScriptedEvaluator(seconds=1)
    dispatcher, _, state = make(evaluator, steps=4, interval=2, before_train=True)
    await dispatcher.after_step(0)
    await train(dispatcher, state, 4)
    assert [p.step for p in dispatcher.points] == [0, 2, 4]


async def test_cancel_settles_pending_points_as_cancelled_and_retires_their_snapshots():
    evaluator = ScriptedEvaluator(seconds=100)
    dispatcher, volume, state = make(evaluator, steps=10, max_in_flight=3)
    for step in (1, 2, 3):
        state["step"] = step
        await dispatcher.after_step(step)
    await asyncio.sleep(5)
    await dispatcher.cancel()
    assert sorted(p.skipped for p in dispatcher.points) == ["cancelled"] * 3
    assert dispatcher.ledger.balanced
    assert dispatcher.pending_steps == []


async def test_a_settled_point_is_not_pending_before_the_next_dispatch():
    """What a checkpoint records as pending (to evaluate again on resume) excludes points settled since."""
    evaluator = ScriptedEvaluator(seconds=1)
    dispatcher, _, state = make(evaluator, steps=10, interval=5, before_train=True)
    await dispatcher.after_step(0)
    assert dispatcher.pending_steps == [0]
    await asyncio.sleep(5)
    assert [p.step for p in dispatcher.points] == [0] and dispatcher.pending_steps == []


async def test_a_snapshot_still_being_written_is_not_deleted_even_if_its_point_is_cancelled_twice():
    evaluator = ScriptedEvaluator(seconds=1)
    dispatcher, volume, state = make(evaluator, steps=10, keep=0, exporter_kwargs={"write_s": 50.0})
    state["step"] = 1
    await dispatcher.after_step(1)
    (pending,) = dispatcher._pending
    await asyncio.sleep(1)
    pending.task.cancel()  # the point now waits for the writer before it retires the directory
    await asyncio.sleep(1)
    pending.task.cancel()
    await asyncio.sleep(1)
    assert volume.removed == [] and not pending.task.done()
    await asyncio.wait([pending.task])
    assert pending.task.cancelled()
    assert asyncio.get_running_loop().time() >= 50
    assert volume.removed == [str(volume.directory(1))]
    assert [p.skipped for p in dispatcher.points] == ["cancelled"]


async def test_a_snapshot_posture_needs_a_volume():
    with pytest.raises(ValueError, match="volume"):
        EvalDispatcher(run="x", evaluator=ScriptedEvaluator(), max_in_flight=1, overflow_policy="skip",
                       keep_snapshots=1, interval_steps=1, final_step=1, before_train=False, current_step=lambda: 0)


async def test_a_resumed_dispatcher_keeps_settled_points_and_dispatches_pending_ones_again():
    from rlfleet.orchestrator.evaluation.policy import EvalPoint

    evaluator = ScriptedEvaluator(seconds=5)
    dispatcher, volume, state = make(evaluator, steps=12, interval=3, run="resumed")
    settled = EvalPoint(step=3, posture="external", weight_version="3",
                        datasets={"d": DatasetScore("d", 0.5, samples=1)})
    before = skipped("resumed", "ckpt_missing")
    state["step"] = 6
    # Checkpoint of step 6: point 3 had settled, points 5 (an earlier step) and 6 were pending.
    await dispatcher.resume([settled], [6, 5], current_step=6)
    await dispatcher.drain()
    by_step = {p.step: p for p in dispatcher.points}
    assert sorted(by_step) == [3, 5, 6]
    assert by_step[3] is settled and evaluator.evaluated == [6] and by_step[6].skipped is None
    assert by_step[5].skipped == "ckpt_missing" and "weights of step 6" in by_step[5].detail
    assert skipped("resumed", "ckpt_missing") == before + 1
    assert volume.dirs == {"/volume/eval/step_6"}  # kept: keepSnapshots 2, nothing leaked
