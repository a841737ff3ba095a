"""A producer that stops on an error (the reward function raised, the task's prompts ran out, a bug) fails the
step's group collection at once with that cause, not at the step's 900 s timeout (looptime: the virtual clock
would run to it). The client is a stand-in that answers every request at once (no I/O)."""
from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest

from rlfleet.crds.loader import load_training_run
from rlfleet.errors import RunError
from rlfleet.orchestrator.rollout.producer import RolloutProducer, RolloutProducerFailed, SamplingSettings
from rlfleet.orchestrator.run.loop import RunLoop, RunOptions
from rlfleet.trainer.grpo import StalenessPolicy

pytestmark = pytest.mark.looptime

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
PROMPTS_PER_STEP = 4
STEP_TIMEOUT_S = 900.0


class Answers:
    """generate() answers at once, as an engine at weight version "0" would."""

    def __init__(self, meta: dict | None = None) -> None:
        self.meta = {"output_token_logprobs": [[-0.5, 7, None]], "weight_version": "0"} if meta is None else meta

    async def generate(self, request_id: str, payload: dict) -> dict:
        await asyncio.sleep(0.1)
        return {"text": "x", "output_ids": [7], "meta_info": self.meta}


def run_loop(tmp_path: Path) -> RunLoop:
    run = load_training_run(QUICKSTART)
    run.spec.trainer.prompts_per_step = PROMPTS_PER_STEP
    return RunLoop(run, RunOptions(run_dir=tmp_path / "run", step_group_timeout_s=STEP_TIMEOUT_S),
                   snapshots=tmp_path / "snapshots")


def producer(prompts, reward=lambda prompt, text, answer: 1.0, client=None, concurrency: int = 2,
             prompts_before: int = 0) -> RolloutProducer:
    return RolloutProducer(client or Answers(), prompts, reward, lambda text: [1, 2], samples_per_prompt=2,
                           sampling=SamplingSettings(), concurrency=concurrency, queue_groups=8, run_id="run",
                           prompts_before=prompts_before)


async def collect_failure(tmp_path: Path, rollout: RolloutProducer, steps: int = 1) -> RolloutProducerFailed:
    """The error the loop's group collection fails with, within `steps` steps (each step's groups collected)."""
    loop = run_loop(tmp_path)
    policy = StalenessPolicy(1)
    rollout.start()
    try:
        with pytest.raises(RolloutProducerFailed) as failed:
            for step in range(steps):
                groups, _ = await loop._collect_groups(rollout, step, policy)
                assert len(groups) == PROMPTS_PER_STEP
    finally:
        await rollout.stop()
    assert asyncio.get_running_loop().time() < 60, "failed at the step's timeout, not at once"
    assert isinstance(failed.value, RunError)  # the run fails with its reason and message
    return failed.value


def raising_on(call: int):
    """A reward function whose `call`-th call raises."""
    calls = itertools.count(1)

    def reward(prompt: str, text: str, answer: str) -> float:
        if next(calls) == call:
            raise ValueError(f"cannot score {text!r}")
        return 1.0

    return reward


async def test_a_reward_function_that_raises_fails_the_step_at_once_naming_it_and_its_group(tmp_path: Path):
    failure = await collect_failure(tmp_path, producer(itertools.repeat(("p", "a")), reward=raising_on(3)))
    assert failure.reason == "RewardFunctionFailed"
    assert str(failure).startswith("the reward function raised ValueError: cannot score 'x' on group run-g")
    assert isinstance(failure.__cause__, ValueError)


async def test_a_finite_task_fails_once_its_prompts_ran_out_after_its_groups_were_taken(tmp_path: Path):
    six = iter([(f"p{i}", "a") for i in range(6)])  # a step and a half
    failure = await collect_failure(tmp_path, producer(six), steps=2)
    assert failure.reason == "TaskPromptsExhausted"
    assert str(failure).startswith("the task's prompts ran out after 6 groups (a task must be endless or hold at "
                                   "least steps x promptsPerStep prompts")


async def test_a_resumed_run_counts_the_tasks_prompts_from_the_start_of_the_task(tmp_path: Path):
    """Resumed after 10 of the task's prompts: when the six left run out it says "after 16", and a task that
    raises on its second prompt after the resume names prompt 12: counted as the task counts them."""
    six = iter([(f"p{i}", "a") for i in range(10, 16)])
    failure = await collect_failure(tmp_path, producer(six, prompts_before=10), steps=2)
    assert str(failure).startswith("the task's prompts ran out after 16 groups"), failure

    def problems():
        yield "p10", "a"
        raise KeyError("row 11")

    failure = await collect_failure(tmp_path, producer(problems(), prompts_before=10))
    assert str(failure) == "the task raised KeyError: 'row 11' on prompt 12"


async def test_the_groups_in_flight_when_the_prompts_run_out_still_train(tmp_path: Path):
    """Eight workers draw all six prompts at once, and the seventh draw finds none while the six groups are
    still generated: they are finished and handed out (step 1 trains), the failure comes at step 2."""
    rollout = producer(iter([(f"p{i}", "a") for i in range(6)]), concurrency=8)
    loop, policy = run_loop(tmp_path), StalenessPolicy(1)
    rollout.start()
    try:
        groups, _ = await loop._collect_groups(rollout, 0, policy)
        assert len(groups) == PROMPTS_PER_STEP
        with pytest.raises(RolloutProducerFailed, match="the task's prompts ran out after 6 groups"):
            await loop._collect_groups(rollout, 1, policy)
    finally:
        await rollout.stop()


async def test_a_task_that_raises_fails_the_step_naming_it(tmp_path: Path):
    def problems():
        yield "p0", "a"
        raise KeyError("row 1")

    failure = await collect_failure(tmp_path, producer(problems()))
    assert failure.reason == "TaskFailed"
    assert str(failure) == "the task raised KeyError: 'row 1' on prompt 2"


async def test_any_other_error_of_the_producer_fails_the_step_naming_it(tmp_path: Path):
    no_version = Answers({"output_token_logprobs": [[-0.5, 7, None]]})  # an engine without weight versions
    failure = await collect_failure(tmp_path, producer(itertools.repeat(("p", "a")), client=no_version))
    assert failure.reason == "RolloutProducerFailed"
    assert str(failure) == ("the rollout producer failed: ValueError: generate answer has no "
                            "meta_info.weight_version")


class SlowToUnwind(Answers):
    """The first `quick` requests are answered at once; later ones are never answered, and a cancelled
    one takes a second to unwind (as an HTTP request's cleanup does)."""

    def __init__(self, quick: int) -> None:
        super().__init__()
        self.calls = itertools.count()
        self.quick = quick

    async def generate(self, request_id: str, payload: dict) -> dict:
        if next(self.calls) < self.quick:
            return await super().generate(request_id, payload)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.shield(asyncio.sleep(1))
            raise
        raise AssertionError("never answered")


async def test_a_fleet_resize_while_the_workers_end_on_an_error_starts_none_and_keeps_the_error(tmp_path: Path):
    """The reward function raises on the first group while the other worker's request is still unwinding:
    a resize in that window (the loop's resize listener calls set_concurrency) neither raises nor hides
    the producer's failure."""
    rollout = producer(itertools.repeat(("p", "a")), reward=raising_on(1), client=SlowToUnwind(quick=2))
    rollout.start()
    try:
        await asyncio.sleep(0.5)  # the first group failed; the second worker's request takes 1 s to unwind
        assert rollout.failure is None
        rollout.set_concurrency(4)
        with pytest.raises(RolloutProducerFailed, match="the reward function raised ValueError"):
            await rollout.next_group()
    finally:
        await rollout.stop()
