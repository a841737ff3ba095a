"""The rollout request path: one sample -> POST {router}/generate, with bounded, classified retries.

Miles retries any error 60 times at a fixed 1 s, which turns a dead fleet into a 503 storm. Here:
- every attempt's result is classified; only what another try can fix is retried (503, connection
  refused or closed, timeout, 5xx, an abort answered as HTTP 200, a duplicate rid still being torn
  down); a 4xx is a bug in the request and fails at once;
- retries are few (`max_attempts`) with exponential backoff and full jitter, and the whole request has
  a deadline that no attempt or backoff sleep may cross;
- every failed attempt is timestamped into the 503 watchdog, which fails the run if they never stop;
- the sample's id is its rid on every attempt, so one engine never runs the same sample twice at once,
  and `generate()` returns at most one answer per sample: an attempt is cancelled (connection closed,
  which makes SGLang abort it) before the next one starts. `RolloutLedger` enforces exactly-once
  delivery across a batch.
"""
from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import aiohttp

from rlfleet.observability import metrics
from rlfleet.sglang.engine import raise_if_aborted
from rlfleet.sglang.errors import CallError, FailureKind
from rlfleet.sglang.http import call, expect_dict

log = logging.getLogger(__name__)


OK = "ok"  # attempt label of a success; failures are labelled by their FailureKind
DUPLICATE_RID = "duplicate_rid"  # a 400 while the engine still holds the previous attempt of this sample

# What another try can fix: the engine or router is gone, busy, slow, or aborted the request (a pause
# or weight update answers in-flight requests with an HTTP 200 abort).
RETRYABLE_KINDS = frozenset({
    FailureKind.CONNECTION_REFUSED, FailureKind.CONNECTION_CLOSED, FailureKind.TIMEOUT,
    FailureKind.UNAVAILABLE, FailureKind.SERVER_ERROR, FailureKind.ABORTED,
})
RETRYABLE_CLIENT_STATUSES = frozenset({408, 429})


def is_duplicate_rid(error: CallError) -> bool:
    return error.kind is FailureKind.CLIENT_ERROR and error.status == 400 and "Duplicate request ID" in error.body


def attempt_label(error: CallError) -> str:
    """The metric label of a failed attempt."""
    return DUPLICATE_RID if is_duplicate_rid(error) else error.kind.value


def is_retryable(error: CallError) -> bool:
    """Could another attempt succeed? A 4xx (other than 408/429/duplicate rid) is our request's fault."""
    if error.kind in RETRYABLE_KINDS:
        return True
    if error.kind is FailureKind.CLIENT_ERROR:
        return error.status in RETRYABLE_CLIENT_STATUSES or is_duplicate_rid(error)
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """Bounds of one rollout request. Full jitter spreads the retries of many requests apart."""

    max_attempts: int = 5
    backoff_base_s: float = 0.5
    backoff_max_s: float = 8.0
    deadline_s: float = 1800.0  # generation can take minutes; the router's own limit is 1800 s
    attempt_timeout_s: float | None = None  # None: whatever is left of the deadline

    def __post_init__(self):
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be 1 or more")
        if self.backoff_base_s < 0 or self.backoff_max_s < self.backoff_base_s:
            raise ValueError("need 0 <= backoff_base_s <= backoff_max_s")
        if self.deadline_s <= 0:
            raise ValueError("deadline_s must be positive")


@dataclass(frozen=True)
class Retry:
    delay_s: float


@dataclass(frozen=True)
class GiveUp:
    outcome: str  # failed | deadline
    why: str


def next_step(policy: RetryPolicy, attempt: int, error: CallError, elapsed_s: float,
              rng: random.Random) -> Retry | GiveUp:
    """After failed attempt number `attempt` (1-based), `elapsed_s` into the request: retry or stop."""
    label = attempt_label(error)
    if not is_retryable(error):
        return GiveUp("failed", f"{label} is not retryable")
    if attempt >= policy.max_attempts:
        return GiveUp("failed", f"{attempt} attempts, last {label}")
    delay = rng.uniform(0.0, min(policy.backoff_max_s, policy.backoff_base_s * 2 ** (attempt - 1)))
    if elapsed_s + delay >= policy.deadline_s:
        return GiveUp("deadline", f"deadline of {policy.deadline_s:g} s reached after {attempt} attempts, last {label}")
    return Retry(delay)


class RolloutRequestFailed(Exception):
    """A sample got no answer within its attempts or deadline (or the request itself is wrong)."""

    def __init__(self, sample_id: str, outcome: str, why: str, last: CallError):
        super().__init__(f"sample {sample_id}: {why}: {last}")
        self.sample_id = sample_id
        self.outcome = outcome
        self.last = last


async def post_generate(session: aiohttp.ClientSession, url: str, payload: Mapping, timeout_s: float) -> dict:
    """One POST /generate: the answer, or the classified CallError (an abort in a 200 included)."""
    reply = await call(session, "POST", url, timeout_s=timeout_s, json_body=dict(payload))
    return raise_if_aborted(reply, expect_dict(reply, "generate"))


FailureSink = Callable[[float], None]  # e.g. WatchdogTask.record_failure
# Sends one attempt: (payload, timeout_s) -> answer, raising CallError. The default posts to the router.
Transport = Callable[[Mapping, float], Awaitable[dict]]


class RolloutClient:
    """Sends samples to the router. `on_failure(t)` gets the loop time of every failed attempt."""

    def __init__(self, router_url: str, session: aiohttp.ClientSession | None, *,
                 policy: RetryPolicy | None = None, on_failure: FailureSink | None = None,
                 fleet: str = "rollout", rng: random.Random | None = None, transport: Transport | None = None):
        self.generate_url = router_url.rstrip("/") + "/generate"
        if transport is None:
            if session is None:
                raise ValueError("RolloutClient needs an HTTP session or a transport")
            url = self.generate_url

            async def transport(payload: Mapping, timeout_s: float) -> dict:
                return await post_generate(session, url, payload, timeout_s)
        self._send = transport
        self.policy = policy or RetryPolicy()
        self.on_failure = on_failure
        self.fleet = fleet
        self.rng = rng or random.Random()

    async def generate(self, sample_id: str, payload: Mapping) -> dict:
        """The answer for one sample (its JSON body), or RolloutRequestFailed."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        request = {**payload, "rid": sample_id}
        attempt = 0
        while True:
            attempt += 1
            elapsed = loop.time() - started
            budget = self.policy.deadline_s - elapsed
            timeout = budget if self.policy.attempt_timeout_s is None else min(budget, self.policy.attempt_timeout_s)
            try:
                answer = await self._send(request, timeout)
            except CallError as error:
                metrics.ROLLOUT_ATTEMPTS.labels(fleet=self.fleet, result=attempt_label(error)).inc()
                if self.on_failure is not None:
                    self.on_failure(loop.time())
                step = next_step(self.policy, attempt, error, loop.time() - started, self.rng)
                if isinstance(step, GiveUp):
                    self._settle(step.outcome, started)
                    raise RolloutRequestFailed(sample_id, step.outcome, step.why, error) from error
                log.debug("sample %s attempt %d failed (%s); retrying in %.2f s", sample_id, attempt, error,
                          step.delay_s)
                await asyncio.sleep(step.delay_s)
                continue
            metrics.ROLLOUT_ATTEMPTS.labels(fleet=self.fleet, result=OK).inc()
            self._settle(OK, started)
            return answer

    def _settle(self, outcome: str, started: float) -> None:
        metrics.ROLLOUT_REQUESTS.labels(fleet=self.fleet, outcome=outcome).inc()
        metrics.ROLLOUT_REQUEST_DURATION.labels(fleet=self.fleet).observe(asyncio.get_running_loop().time() - started)


class DuplicateDelivery(RuntimeError):
    pass


@dataclass
class RolloutLedger:
    """Each sample is delivered to the caller at most once: a second delivery is a bug, loudly."""

    delivered: dict[str, dict] = field(default_factory=dict)
    failed: dict[str, RolloutRequestFailed] = field(default_factory=dict)

    def deliver(self, sample_id: str, answer: dict) -> None:
        if sample_id in self.delivered:
            raise DuplicateDelivery(f"sample {sample_id} delivered twice")
        self.failed.pop(sample_id, None)
        self.delivered[sample_id] = answer

    def fail(self, sample_id: str, error: RolloutRequestFailed) -> None:
        if sample_id not in self.delivered:
            self.failed[sample_id] = error


async def generate_all(client: RolloutClient, samples: Mapping[str, Mapping], *, concurrency: int = 64) -> RolloutLedger:
    """Run every sample through `client` (at most `concurrency` at once); each settles exactly once."""
    ledger = RolloutLedger()
    gate = asyncio.Semaphore(concurrency)

    async def one(sample_id: str, payload: Mapping) -> None:
        async with gate:
            try:
                ledger.deliver(sample_id, await client.generate(sample_id, payload))
            except RolloutRequestFailed as exc:
                ledger.fail(sample_id, exc)

    async with asyncio.TaskGroup() as group:
        for sample_id, payload in samples.items():
            group.create_task(one(sample_id, payload))
    return ledger
