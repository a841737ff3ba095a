"""Rollout request path: what is retried, the retry plan, and the client's loop (looptime)."""
from __future__ import annotations

import asyncio
import random

import pytest

from rlfleet.orchestrator.rollout.client import (
    DuplicateDelivery,
    GiveUp,
    Retry,
    RetryPolicy,
    RolloutClient,
    RolloutLedger,
    RolloutRequestFailed,
    attempt_label,
    attempt_timeout,
    generate_all,
    is_retryable,
    next_step,
)
from rlfleet.sglang.errors import CallError, FailureKind, error_for

K = FailureKind
ANSWER = {"text": "hi", "meta_info": {"id": "s", "finish_reason": {"type": "length", "length": 2}}}


def err(kind: FailureKind, status: int | None = None, body: str = "") -> CallError:
    return error_for(kind, body or kind.value, status=status, body=body)


@pytest.mark.parametrize("error, retry, label", [
    (err(K.UNAVAILABLE, 503, '{"error":{"code":"no_available_workers"}}'), True, "unavailable"),
    (err(K.CONNECTION_REFUSED), True, "connection_refused"),
    (err(K.CONNECTION_CLOSED), True, "connection_closed"),
    (err(K.TIMEOUT), True, "timeout"),
    (err(K.SERVER_ERROR, 500, "call_upstream_request_error"), True, "server_error"),
    (err(K.ABORTED, 200, '{"meta_info":{"finish_reason":{"type":"abort"}}}'), True, "aborted"),
    (err(K.CLIENT_ERROR, 429), True, "client_error"),
    (err(K.CLIENT_ERROR, 408), True, "client_error"),
    (err(K.CLIENT_ERROR, 400, '{"error":{"message":"Duplicate request ID detected: s1"}}'), True, "duplicate_rid"),
    (err(K.CLIENT_ERROR, 400, '{"error":"unknown field `foo`"}'), False, "client_error"),
    (err(K.CLIENT_ERROR, 422, "Failed to deserialize"), False, "client_error"),
    (err(K.BAD_RESPONSE, 200, "not json"), False, "bad_response"),
])
def test_what_is_retried(error, retry, label):
    assert is_retryable(error) is retry
    assert attempt_label(error) == label


def test_backoff_is_exponential_with_full_jitter_and_capped():
    policy = RetryPolicy(max_attempts=10, backoff_base_s=0.5, backoff_max_s=4, deadline_s=1e9)
    rng = random.Random(0)
    for attempt, cap in [(1, 0.5), (2, 1), (3, 2), (4, 4), (5, 4), (9, 4)]:
        delays = [next_step(policy, attempt, err(K.UNAVAILABLE, 503), 0, rng).delay_s for _ in range(200)]
        assert min(delays) >= 0 and max(delays) <= cap
        assert max(delays) > 0.8 * cap  # jitter covers the range, not a fixed sleep
        assert len(set(delays)) > 150


def test_gives_up_after_max_attempts_on_client_errors_and_at_the_deadline():
    policy = RetryPolicy(max_attempts=3, deadline_s=10)
    rng = random.Random(0)
    refused = err(K.CONNECTION_REFUSED)
    assert isinstance(next_step(policy, 2, refused, 0, rng), Retry)
    assert next_step(policy, 3, refused, 0, rng) == GiveUp("failed", "3 attempts, last connection_refused")
    assert next_step(policy, 1, err(K.CLIENT_ERROR, 400), 0, rng).outcome == "failed"
    assert next_step(policy, 1, err(K.TIMEOUT), 9.99999, rng).outcome == "deadline"


def test_an_attempt_gets_what_is_left_of_the_deadline_and_none_is_sent_once_it_has_passed():
    assert attempt_timeout(RetryPolicy(deadline_s=10), 4) == 6
    assert attempt_timeout(RetryPolicy(deadline_s=10, attempt_timeout_s=3), 4) == 3
    assert attempt_timeout(RetryPolicy(deadline_s=10, attempt_timeout_s=3), 8.5) == 1.5
    # A backoff sleep, a circuit probe or a lagging loop can end past the deadline: no attempt, whatever is left.
    assert attempt_timeout(RetryPolicy(deadline_s=10), 10) is None
    assert attempt_timeout(RetryPolicy(deadline_s=10, attempt_timeout_s=3), 10.2) is None


@pytest.mark.parametrize("bad", [dict(max_attempts=0), dict(backoff_base_s=2, backoff_max_s=1), dict(deadline_s=0),
                                 dict(attempt_timeout_s=0)])
def test_bad_policies_are_rejected(bad):
    with pytest.raises(ValueError):
        RetryPolicy(**bad)


class Script:
    """A transport that plays back failures (then answers) and records what it was sent."""

    def __init__(self, *failures: CallError):
        self.failures = list(failures)
        self.sent: list[tuple[float, dict, float]] = []

    async def __call__(self, payload, timeout_s):
        self.sent.append((asyncio.get_running_loop().time(), dict(payload), timeout_s))
        if self.failures:
            failure = self.failures.pop(0)
            if failure.kind is K.TIMEOUT:
                await asyncio.sleep(timeout_s)
            raise failure
        return {**ANSWER, "meta_info": {**ANSWER["meta_info"], "id": payload["rid"]}}


@pytest.mark.looptime
async def test_retries_retryable_failures_with_the_same_rid_and_reports_each_failure():
    script = Script(err(K.UNAVAILABLE, 503), err(K.CONNECTION_CLOSED), err(K.ABORTED, 200), err(K.SERVER_ERROR, 500))
    failures: list[float] = []
    client = RolloutClient("http://router", None, transport=script, on_failure=failures.append,
                           policy=RetryPolicy(max_attempts=5, backoff_base_s=1, backoff_max_s=8),
                           rng=random.Random(1), fleet="rollout-test")
    answer = await client.generate("sample-7", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert answer["meta_info"]["id"] == "sample-7"
    assert len(script.sent) == 5
    assert {payload["rid"] for _, payload, _ in script.sent} == {"sample-7"}
    assert len(failures) == 4
    gaps = [b[0] - a[0] for a, b in zip(script.sent, script.sent[1:], strict=False)]
    assert all(0 <= gap <= cap for gap, cap in zip(gaps, [1, 2, 4, 8], strict=False))


@pytest.mark.looptime
async def test_a_dead_router_costs_few_attempts_not_a_storm():
    script = Script(*[err(K.UNAVAILABLE, 503)] * 100)
    failures: list[float] = []
    client = RolloutClient("http://router", None, transport=script, on_failure=failures.append,
                           rng=random.Random(2), fleet="rollout-test")
    with pytest.raises(RolloutRequestFailed) as info:
        await client.generate("s1", {"text": "hi"})
    assert info.value.outcome == "failed" and info.value.last.kind is K.UNAVAILABLE
    assert len(script.sent) == len(failures) == RetryPolicy().max_attempts == 5
    assert asyncio.get_running_loop().time() <= 0.5 + 1 + 2 + 4  # Miles: 60 tries over 60 s


@pytest.mark.looptime
async def test_client_errors_fail_at_once():
    script = Script(err(K.CLIENT_ERROR, 400, '{"error":"unknown field `foo`"}'))
    client = RolloutClient("http://router", None, transport=script, fleet="rollout-test")
    with pytest.raises(RolloutRequestFailed, match="not retryable"):
        await client.generate("s1", {"text": "hi"})
    assert len(script.sent) == 1


@pytest.mark.looptime
async def test_the_deadline_bounds_attempts_and_backoff():
    script = Script(err(K.TIMEOUT), err(K.TIMEOUT), err(K.TIMEOUT))
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
    plans = {f"s{i}": [err(K.CONNECTION_REFUSED)] * (i % 3) for i in range(50)}
    plans["s-bad"] = [err(K.CLIENT_ERROR, 422)]
    remaining = {sid: list(plan) for sid, plan in plans.items()}
    sent: list[str] = []

    async def transport(payload, timeout_s):
        sent.append(payload["rid"])
        await asyncio.sleep(0.1)
        if remaining[payload["rid"]]:
            raise remaining[payload["rid"]].pop(0)
        return {**ANSWER, "rid": payload["rid"]}

    client = RolloutClient("http://router", None, transport=transport, rng=random.Random(4), fleet="rollout-test")
    ledger = await generate_all(client, {sid: {"text": sid} for sid in plans}, concurrency=8)
    assert set(ledger.delivered) == {f"s{i}" for i in range(50)}
    assert all(answer["rid"] == sid for sid, answer in ledger.delivered.items())
    assert set(ledger.failed) == {"s-bad"}
    assert len(sent) == sum(len(plan) for plan in plans.values()) + 50
