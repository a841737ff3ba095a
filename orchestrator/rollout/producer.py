"""The fully-async rollout producer: keeps the engines busy while the trainer steps.

Groups of `samples_per_prompt` samples are generated concurrently through the router and queued
with the weight version each sample was produced under. `pause()` stops new groups from starting
and waits until the groups in flight have finished (nothing is aborted; their samples are kept), so
evaluation on the shared engines and weight syncs see a quiet fleet when they need one.

A lost group (its requests failed) is dropped and counted. Anything else stops the producer for good
(the reward function raised, a bug; a task whose prompts ran out, once the groups in flight are
queued): `next_group()` hands out the groups already queued, then raises that failure, a
RolloutProducerFailed, so the run fails at once with its cause instead of waiting out its step timeout
for groups that will never come.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rlfleet.crds.models import TrainerSpec
from rlfleet.errors import RunError
from rlfleet.orchestrator.rollout.client import RolloutClient, RolloutRequestFailed
from rlfleet.policy.recovery import exponential_backoff
from rlfleet.trainer.grpo import Sample, sample_from_generate
from rlfleet.util.aio import first_error, stop_task

log = logging.getLogger(__name__)

# After a lost group a worker waits before its next one (doubling per group lost in a row, capped), so
# a dead path is not hammered by new groups as fast as the old ones fail.
LOST_GROUP_BACKOFF_BASE_S = 0.5
LOST_GROUP_BACKOFF_MAX_S = 4.0

RewardFn = Callable[[str, str, str], float]  # (prompt, response text, expected answer) -> reward
Encode = Callable[[str], list[int]]


class RolloutProducerFailed(RunError):
    """The producer stopped on an error: no more groups will come. `reason` says whose error it was."""

    reason = "RolloutProducerFailed"


def prompts_ran_out(groups: int) -> RolloutProducerFailed:
    return RolloutProducerFailed(f"the task's prompts ran out after {groups} groups (a task must be endless or "
                                 f"hold at least steps x promptsPerStep prompts, more when groups are lost or "
                                 f"too stale)", reason="TaskPromptsExhausted")


class PromptsRanOut(Exception):
    """The task's prompts are all drawn: the worker that found it ends; groups in flight still finish."""


def unexpected_failure(exc: Exception) -> RolloutProducerFailed:
    """An error nobody expected (a bug), named by its innermost error (a task group's holds others)."""
    cause = first_error(exc)
    return RolloutProducerFailed(f"the rollout producer failed: {type(cause).__name__}: {cause}")


def groups_in_flight(*, requests_per_engine: int, engines: int, samples_per_prompt: int, prompts_per_step: int) -> int:
    """How many groups the producer generates at once: as many as keep `requests_per_engine` requests on each
    engine (`spec.rollout.concurrencyPerEngine`; a group is `samples_per_prompt` requests), no more than one
    step's groups, and at least one group, however large."""
    return max(1, min(requests_per_engine * engines // samples_per_prompt, prompts_per_step))


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()

    def request_params(self) -> dict:
        """SGLang's `sampling_params` for one rollout request."""
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                **({"stop_token_ids": list(self.stop_token_ids)} if self.stop_token_ids else {})}

    @classmethod
    def for_trainer(cls, trainer: TrainerSpec, eos_token_id: int | None) -> SamplingSettings:
        """A run's rollout sampling: `spec.trainer`'s maxNewTokens, temperature and topP, stopping at EOS."""
        return cls(max_new_tokens=trainer.max_new_tokens, temperature=trainer.temperature, top_p=trainer.top_p,
                   stop_token_ids=(eos_token_id,) if eos_token_id is not None else ())


@dataclass
class ProducerStats:
    groups_started: int = 0
    groups_done: int = 0
    groups_failed: int = 0
    samples: int = 0
    generated_tokens: int = 0


class RolloutProducer:
    def __init__(self, client: RolloutClient, prompts: Iterator[tuple[str, str]], reward_fn: RewardFn,
                 encode: Encode, *, samples_per_prompt: int, sampling: SamplingSettings,
                 concurrency: int = 4, queue_groups: int = 16, run_id: str = "run", prompts_before: int = 0):
        """`prompts_before`: the task's prompts drawn before this producer (a run resumed from a checkpoint
        goes on from there): the task's counts and the group ids go on from it too."""
        if samples_per_prompt < 1:
            raise ValueError("samples_per_prompt must be >= 1")
        self.client = client
        self.prompts = prompts
        self.reward_fn = reward_fn
        self.encode = encode
        self.samples_per_prompt = samples_per_prompt
        self.sampling = sampling
        self.concurrency = concurrency
        self.queue: asyncio.Queue[list[Sample]] = asyncio.Queue(maxsize=queue_groups)
        self.stats = ProducerStats()
        self.run_id = run_id
        self.prompts_before = prompts_before
        self._group_ids = itertools.count(prompts_before)
        self._running = asyncio.Event()
        self._running.set()
        self._in_flight = 0
        self._idle = asyncio.Condition()
        self._task: asyncio.Task | None = None
        self._workers: asyncio.TaskGroup | None = None
        self._live: set[int] = set()  # indices of the workers running
        self.failures: list[RolloutRequestFailed] = []
        self.lost_in_a_row = 0
        self.failure: RolloutProducerFailed | None = None  # set once the producer stopped on an error
        self._queued = asyncio.Event()  # a group was queued or the producer failed: wakes next_group
        self._prompts_ran_out = False

    # --- control -----------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="rollout-producer")

    async def stop(self) -> None:
        if self._task is not None:
            await stop_task(self._task)
            self._task = None

    async def pause(self) -> None:
        """Start no new group; return once every group in flight has finished and been queued."""
        self._running.clear()
        async with self._idle:
            await self._idle.wait_for(lambda: self._in_flight == 0)

    def resume(self) -> None:
        self._running.set()

    def set_concurrency(self, groups: int) -> None:
        """Generate `groups` groups at once from now on (the fleet was scaled): missing workers start at
        once, surplus ones stop after the group they are generating (nothing is cut short)."""
        if groups < 1:
            raise ValueError(f"concurrency must be >= 1, got {groups}")
        self.concurrency = groups
        for index in range(groups):
            if index not in self._live:
                self._spawn(index)

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    async def next_group(self) -> list[Sample]:
        """The next group queued. Once the producer has stopped on an error and its queued groups are
        taken, raises that error (RolloutProducerFailed) rather than wait for groups that will never come."""
        # Waiting on an event takes nothing from the queue, so a cancelled wait loses no group.
        while self.queue.empty():
            if self.failure is not None:
                raise self.failure
            self._queued.clear()
            await self._queued.wait()
        return self.queue.get_nowait()

    # --- work --------------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            async with asyncio.TaskGroup() as workers:
                self._workers = workers
                for index in range(self.concurrency):
                    self._spawn(index)
        except ExceptionGroup as group:  # the first worker's error stopped the others
            first = group.exceptions[0]
            self.failure = first if isinstance(first, RolloutProducerFailed) else unexpected_failure(first)
            log.error("rollout producer stopped: %s", self.failure, exc_info=first)  # with the whole traceback
            self._queued.set()
        else:
            if self._prompts_ran_out:  # every worker ended once its groups were queued: none will come
                self.failure = prompts_ran_out(self.prompts_before + self.stats.groups_started)
                log.error("rollout producer stopped: %s", self.failure)
                self._queued.set()
        finally:
            self._workers = None

    def _spawn(self, index: int) -> None:
        if self._workers is None:
            return  # not started (or stopped): `_run` starts as many as `concurrency` says
        worker = self._worker(index)
        try:
            self._workers.create_task(worker, name=f"rollout-worker-{index}")
        except RuntimeError:  # the workers are ending (one failed, or none is left): no new one starts
            worker.close()
            return
        self._live.add(index)

    async def _worker(self, index: int) -> None:
        try:
            while await self._next_group_allowed(index):
                await self._one_group()
        except PromptsRanOut:
            self._prompts_ran_out = True  # this worker ends; the others finish the groups they generate
        except RolloutProducerFailed:
            raise
        except Exception as exc:
            raise unexpected_failure(exc) from exc
        finally:
            self._live.discard(index)

    async def _next_group_allowed(self, index: int) -> bool:
        """Wait until groups may start; False once this worker is one too many (the fleet shrank)."""
        await self._running.wait()
        return index < self.concurrency

    async def _one_group(self) -> None:
        try:
            prompt, answer = next(self.prompts)
        except StopIteration:  # said here: out of a coroutine it would become a bare RuntimeError
            raise PromptsRanOut() from None
        except Exception as exc:  # the task's own code raised
            raise RolloutProducerFailed(f"the task raised {type(exc).__name__}: {exc} on prompt "
                                        f"{self.prompts_before + self.stats.groups_started + 1}",
                                        reason="TaskFailed") from exc
        group_id = f"{self.run_id}-g{next(self._group_ids)}"
        self._in_flight += 1
        self.stats.groups_started += 1
        try:
            group = await self._generate_group(group_id, prompt, answer)
        finally:
            # In flight means "engines are working on it"; a finished group waiting for room in
            # the queue does not hold up pause().
            self._in_flight -= 1
            async with self._idle:
                self._idle.notify_all()
        if group is not None:
            self.lost_in_a_row = 0
            await self.queue.put(group)
            self._queued.set()
        else:
            self.lost_in_a_row += 1
            await asyncio.sleep(exponential_backoff(self.lost_in_a_row - 1, LOST_GROUP_BACKOFF_BASE_S,
                                                    LOST_GROUP_BACKOFF_MAX_S))

    async def _generate_group(self, group_id: str, prompt: str, answer: str) -> list[Sample] | None:
        prompt_ids = self.encode(prompt)
        payload = {
            # The prompt as the trainer scores it: what the engines see is what the trainer recomputes,
            # and a broken generation can continue from prompt + prefix (rlfleet.orchestrator.rollout.client).
            "input_ids": list(prompt_ids),
            "sampling_params": self.sampling.request_params(),
            "return_logprob": True,
        }
        lost: BaseExceptionGroup | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self.client.generate(f"{group_id}-s{i}", payload))
                         for i in range(self.samples_per_prompt)]
        except* RolloutRequestFailed as failed:
            lost = failed
        if lost is not None:
            # A group is normalised as a whole: a partial group is dropped (and counted).
            # The tasks raise RolloutRequestFailed themselves: the group holds no nested groups.
            self.failures.extend(e for e in lost.exceptions if isinstance(e, RolloutRequestFailed))
            self.stats.groups_failed += 1
            log.warning("group %s lost (%d in a row): %s", group_id, self.lost_in_a_row + 1, lost.exceptions[0])
            return None
        samples = []
        for task in tasks:
            body = task.result()
            try:
                reward = float(self.reward_fn(prompt, body.get("text", ""), answer))
            except Exception as exc:  # a bug in the reward is the run's failure, never hidden
                raise RolloutProducerFailed(f"the reward function raised {type(exc).__name__}: {exc} on group "
                                            f"{group_id}", reason="RewardFunctionFailed") from exc
            samples.append(sample_from_generate(prompt_ids, body, group_id=group_id, reward=reward))
            self.stats.generated_tokens += len(body.get("output_ids") or [])
        self.stats.samples += len(samples)
        self.stats.groups_done += 1
        return samples
