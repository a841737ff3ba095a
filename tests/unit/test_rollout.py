"""Rollout request path: classification, the retry plan, and the client's loop (looptime)."""
from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from rlfleet.orchestrator.rollout import (
    Attempt,
    AttemptResult,
    DuplicateDelivery,
    GiveUp,
    Retry,
    RetryPolicy,
    RolloutClient,
    RolloutLedger,
    RolloutRequestFailed,
    classify_exception,
    classify_response,
    generate_all,
    next_step,
)

R = AttemptResult
ANSWER = {"text": "hi", "meta_info": {"id": "s", "finish_reason": {"type": "length", "length": 2}}}


@pytest.mark.parametrize("status, body, text, expected", [
    (200, ANSWER, "", R.OK),
    (200, {"text": "h", "meta_info": {"finish_reason": {"type": "abort", "message": "Aborted"}}}, "", R.ABORTED),
    (200, None, "not json", R.SERVER_ERROR),
    (503, None, '{"error":{"code":"no_available_workers"}}', R.UNAVAILABLE),
    (429, None, "", R.UNAVAILABLE),
    (500, None, "call_upstream_request_error", R.SERVER_ERROR),
    (502, None, "", R.SERVER_ERROR),
    (504, None, "", R.SERVER_ERROR),
    (408, None, "", R.TIMEOUT),
    (400, None, '{"error":{"message":"Duplicate request ID detected: s1"}}', R.DUPLICATE_RID),
    (400, None, '{"error":"unknown field `foo`"}', R.CLIENT_ERROR),
    (422, None, "Failed to deserialize", R.CLIENT_ERROR),
    (404, None, "", R.CLIENT_ERROR),
])
def test_classify_response(status, body, text, expected):
    assert classify_response(status, body, text) is expected


def test_classify_exceptions():
    assert classify_exception(TimeoutError()) is R.TIMEOUT
    assert classify_exception(ConnectionRefusedError()) is R.CONNECTION
    assert classify_exception(aiohttp.ServerDisconnectedError()) is R.CONNECTION
    with pytest.raises(KeyError):
        classify_exception(KeyError("a bug stays a bug"))


def test_backoff_is_exponential_with_full_jitter_and_capped():
    policy = RetryPolicy(max_attempts=10, backoff_base_s=0.5, backoff_max_s=4, deadline_s=1e9)
    rng = random.Random(0)
    for attempt, cap in [(1, 0.5), (2, 1), (3, 2), (4, 4), (5, 4), (9, 4)]:
        delays = [next_step(policy, attempt, R.UNAVAILABLE, 0, rng).delay_s for _ in range(200)]
        assert 0 <= min(delays) and max(delays) <= cap
        assert max(delays) > 0.8 * cap  # jitter covers the range, not a fixed sleep
        assert len(set(delays)) > 150


def test_gives_up_after_max_attempts_on_client_errors_and_at_the_deadline():
    policy = RetryPolicy(max_attempts=3, deadline_s=10)
    rng = random.Random(0)
    assert isinstance(next_step(policy, 2, R.CONNECTION, 0, rng), Retry)
    assert next_step(policy, 3, R.CONNECTION, 0, rng) == GiveUp("failed", "3 attempts, last connection")
    assert next_step(policy, 1, R.CLIENT_ERROR, 0, rng).outcome == "failed"
    assert next_step(policy, 1, R.TIMEOUT, 9.99999, rng).outcome == "deadline"


@pytest.mark.parametrize("bad", [dict(max_attempts=0), dict(backoff_base_s=2, backoff_max_s=1), dict(deadline_s=0)])
def test_bad_policies_are_rejected(bad):
    with pytest.raises(ValueError):
        RetryPolicy(**bad)


class Script:
    """A transport that plays back attempt results and records what it was sent."""

    def __init__(self, *results: AttemptResult, answer_after_s: float = 0.0):
        self.results = list(results)
        self.sent: list[tuple[float, dict, float]] = []
        self.answer_after_s = answer_after_s

    async def __call__(self, payload, timeout_s):
        loop = asyncio.get_running_loop()
        self.sent.append((loop.time(), dict(payload), timeout_s))
        result = self.results.pop(0) if self.results else R.OK
        if result is R.TIMEOUT:
            await asyncio.sleep(timeout_s)
            return Attempt(R.TIMEOUT, None, "TimeoutError")
        await asyncio.sleep(self.answer_after_s)
        body = {**ANSWER, "meta_info": {**ANSWER["meta_info"], "id": payload["rid"]}} if result is R.OK else None
        return Attempt(result, body, "" if result is R.OK else result.value)


@pytest.mark.looptime
async def test_retries_retryable_failures_with_the_same_rid_and_reports_each_failure():
    script = Script(R.UNAVAILABLE, R.CONNECTION, R.ABORTED, R.SERVER_ERROR)
    failures: list[float] = []
    client = RolloutClient("http://router", None, transport=script, on_failure=failures.append,
                           policy=RetryPolicy(max_attempts=5, backoff_base_s=1, backoff_max_s=8),
                           rng=random.Random(1), fleet="rollout-test")
    answer = await client.generate("sample-7", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert answer["meta_info"]["id"] == "sample-7"
    assert len(script.sent) == 5
    assert {payload["rid"] for _, payload, _ in script.sent} == {"sample-7"}
    assert len(failures) == 4
    gaps = [b[0] - a[0] for a, b in zip(script.sent, script.sent[1:])]
    assert all(0 <= gap <= cap for gap, cap in zip(gaps, [1, 2, 4, 8]))


@pytest.mark.looptime
async def test_a_dead_router_costs_few_attempts_not_a_storm():
    script = Script(*[R.UNAVAILABLE] * 100)
    failures: list[float] = []
    client = RolloutClient("http://router", None, transport=script, on_failure=failures.append,
                           rng=random.Random(2), fleet="rollout-test")
    with pytest.raises(RolloutRequestFailed) as info:
        await client.generate("s1", {"text": "hi"})
    assert info.value.outcome == "failed" and info.value.last is R.UNAVAILABLE
    assert len(script.sent) == len(failures) == RetryPolicy().max_attempts == 5
    assert asyncio.get_running_loop().time() <= 0.5 + 1 + 2 + 4  # Miles: 60 tries over 60 s


@pytest.mark.looptime
async def test_client_errors_fail_at_once():
    script = Script(R.CLIENT_ERROR)
    client = RolloutClient("http://router", None, transport=script, fleet="rollout-test")
    with pytest.raises(RolloutRequestFailed, match="not retryable"):
        await client.generate("s1", {"text": "hi"})
    assert len(script.sent) == 1


@pytest.mark.looptime
async def test_the_deadline_bounds_attempts_and_backoff():
    script = Script(R.TIMEOUT, R.TIMEOUT, R.TIMEOUT)
    client = RolloutClient("http://router", None, transport=script, rng=random.Random(3), fleet="rollout-test",
                           policy=RetryPolicy(max_attempts=10, deadline_s=100, attempt_timeout_s=40))
    with pytest.raises(RolloutRequestFailed) as info:
        await client.generate("s1", {"text": "hi"})
    assert info.value.outcome == "deadline"
    assert asyncio.get_running_loop().time() <= 100
    assert script.sent[0][2] == 40 and all(timeout <= 100 - t for t, _, timeout in script.sent)


def test_ledger_refuses_a_second_delivery():
    ledger = RolloutLedger()
    ledger.deliver("s1", ANSWER)
    with pytest.raises(DuplicateDelivery):
        ledger.deliver("s1", ANSWER)


@pytest.mark.looptime
async def test_generate_all_settles_every_sample_exactly_once():
    outcomes = {f"s{i}": ([R.CONNECTION] * (i % 3)) for i in range(50)}
    outcomes["s-bad"] = [R.CLIENT_ERROR]
    per_sample = {sid: list(results) for sid, results in outcomes.items()}
    sent: list[str] = []

    async def transport(payload, timeout_s):
        sent.append(payload["rid"])
        queue = per_sample[payload["rid"]]
        result = queue.pop(0) if queue else R.OK
        await asyncio.sleep(0.1)
        return Attempt(result, {**ANSWER, "rid": payload["rid"]} if result is R.OK else None)

    client = RolloutClient("http://router", None, transport=transport, rng=random.Random(4), fleet="rollout-test")
    ledger = await generate_all(client, {sid: {"text": sid} for sid in outcomes}, concurrency=8)
    assert set(ledger.delivered) == {f"s{i}" for i in range(50)}
    assert all(answer["rid"] == sid for sid, answer in ledger.delivered.items())
    assert set(ledger.failed) == {"s-bad"}
    assert len(sent) == sum(len(v) for v in outcomes.values()) + 50 + 0
