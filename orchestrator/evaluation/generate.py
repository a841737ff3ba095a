"""Generate and score eval datasets through one SGLang `/generate` endpoint (a router or an engine).

Every sample records the weight version the engine reported, so a point can prove it measured one
version (mixed-version ratio 0). A sample that fails after its retries makes the whole point fail
with EvalSkip("unhealthy"): partial datasets would bias the score.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import aiohttp

from rlfleet.orchestrator.evaluation.api import EvalSkip
from rlfleet.orchestrator.evaluation.datasets import EvalDataset
from rlfleet.orchestrator.evaluation.policy import DatasetScore, SampleOutcome, score_dataset
from rlfleet.sglang.engine import raise_if_aborted
from rlfleet.sglang.errors import CallError, ClientErrorStatus, RequestAborted
from rlfleet.sglang.http import call, expect_dict

log = logging.getLogger(__name__)

ATTEMPTS = 3
RETRY_DELAY_S = 0.5


async def _generate_one(session: aiohttp.ClientSession, url: str, payload: dict, timeout_s: float) -> dict:
    last: Exception | None = None
    for attempt in range(ATTEMPTS):
        try:
            reply = await call(session, "POST", url, timeout_s=timeout_s, json_body=payload)
            return raise_if_aborted(reply, expect_dict(reply, "generate"))
        except ClientErrorStatus:
            raise  # the request is wrong; another try cannot help
        except RequestAborted as exc:
            last = RuntimeError(f"generation aborted: {exc.message}")
        except CallError as exc:
            last = exc
        await asyncio.sleep(RETRY_DELAY_S * (attempt + 1))
    raise EvalSkip("unhealthy", f"{url}: no answer after {ATTEMPTS} attempts: {last}")


def _outcome(dataset: EvalDataset, prompt: str, answer: str, body: dict) -> SampleOutcome:
    meta = body.get("meta_info") or {}
    finish = meta.get("finish_reason")
    text = body.get("text", "")
    try:
        reward: float | None = float(dataset.reward_fn(prompt, text, answer))
    except Exception as exc:
        log.warning("dataset %s: reward function failed on %r: %s", dataset.name, prompt[:80], exc)
        reward = None
    tokens = meta.get("completion_tokens")
    if tokens is None:
        tokens = len(body.get("output_ids") or [])
    version = meta.get("weight_version")
    return SampleOutcome(reward=reward, response_tokens=int(tokens),
                         finish=finish.get("type") if isinstance(finish, dict) else None,
                         weight_version=None if version is None else str(version))


async def evaluate_datasets(session: aiohttp.ClientSession, base_url: str, datasets: Sequence[EvalDataset], *,
                            expected_version: str, concurrency: int = 16, timeout_s: float = 300.0,
                            rid_prefix: str = "eval") -> dict[str, DatasetScore]:
    """Generate every sample of every dataset through `base_url`/generate and score each dataset."""
    url = base_url.rstrip("/") + "/generate"
    gate = asyncio.Semaphore(concurrency)

    async def one(dataset: EvalDataset, index: int, prompt: str, answer: str, k: int) -> SampleOutcome:
        payload = {"text": prompt, "sampling_params": dataset.sampling_params(),
                   "rid": f"{rid_prefix}-{dataset.name}-{index}-{k}"}
        async with gate:
            body = await _generate_one(session, url, payload, timeout_s)
        return _outcome(dataset, prompt, answer, body)

    results: dict[str, DatasetScore] = {}
    for dataset in datasets:
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(dataset, i, prompt, answer, k))
                         for i, (prompt, answer) in enumerate(dataset.problems)
                         for k in range(dataset.samples_per_prompt)]
        except* EvalSkip as skips:
            raise skips.exceptions[0] from None
        results[dataset.name] = score_dataset(dataset.name, [t.result() for t in tasks], expected_version)
    return results
