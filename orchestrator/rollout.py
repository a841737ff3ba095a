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
import enum
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import aiohttp

from rlfleet import metrics

log = logging.getLogger(__name__)


class AttemptResult(enum.StrEnum):
    OK = "ok"
    UNAVAILABLE = "unavailable"  # 503 (no engine can take it), 429
    CONNECTION = "connection"  # refused, reset, closed without an answer
    TIMEOUT = "timeout"  # no answer within the attempt's time
    SERVER_ERROR = "server_error"  # 500/502/504: e.g. the router tried an engine that just died
    ABORTED = "aborted"  # HTTP 200 with finish_reason abort (pause, weight update)
    DUPLICATE_RID = "duplicate_rid"  # the engine still holds the previous attempt of this sample
    CLIENT_ERROR = "client_error"  # any other 4xx: the request is wrong, retrying cannot help


RETRYABLE = frozenset(AttemptResult) - {AttemptResult.OK, AttemptResult.CLIENT_ERROR}


def classify_response(status: int, body: object, text: str = "") -> AttemptResult:
    """Classify an HTTP answer. `body` is the parsed JSON (None if not JSON), `text` the raw body."""
    if status == 200:
        if isinstance(body, dict):
            finish = (body.get("meta_info") or {}).get("finish_reason") or {}
            if isinstance(finish, dict) and finish.get("type") == "abort":
                return AttemptResult.ABORTED
            return AttemptResult.OK
        return AttemptResult.SERVER_ERROR  # a 200 that is not a generation answer
    if status in (503, 429):
        return AttemptResult.UNAVAILABLE
    if status == 408:
        return AttemptResult.TIMEOUT
    if status >= 500:
        return AttemptResult.SERVER_ERROR
    if status == 400 and "Duplicate request ID" in text:
        return AttemptResult.DUPLICATE_RID
    return AttemptResult.CLIENT_ERROR


def classify_exception(exc: BaseException) -> AttemptResult:
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
        return AttemptResult.TIMEOUT
    if isinstance(exc, aiohttp.ClientError | ConnectionError | OSError):
        return AttemptResult.CONNECTION
    raise exc


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


def next_step(policy: RetryPolicy, attempt: int, result: AttemptResult, elapsed_s: float,
              rng: random.Random) -> Retry | GiveUp:
    """After failed attempt number `attempt` (1-based), `elapsed_s` into the request: retry or stop."""
    if result not in RETRYABLE:
        return GiveUp("failed", f"{result.value} is not retryable")
    if attempt >= policy.max_attempts:
        return GiveUp("failed", f"{attempt} attempts, last {result.value}")
    delay = rng.uniform(0.0, min(policy.backoff_max_s, policy.backoff_base_s * 2 ** (attempt - 1)))
    if elapsed_s + delay >= policy.deadline_s:
        return GiveUp("deadline", f"deadline of {policy.deadline_s:.0f} s reached after {attempt} attempts, "
                                  f"last {result.value}")
    return Retry(delay)


class RolloutRequestFailed(Exception):
    """A sample got no answer within its attempts or deadline (or the request itself is wrong)."""

    def __init__(self, sample_id: str, outcome: str, why: str, last: AttemptResult, detail: str = ""):
        super().__init__(f"sample {sample_id}: {why}" + (f": {detail}" if detail else ""))
        self.sample_id = sample_id
        self.outcome = outcome
        self.last = last
        self.detail = detail


@dataclass(frozen=True)
class Attempt:
    result: AttemptResult
    body: object = None
    detail: str = ""


async def post_generate(session: aiohttp.ClientSession, url: str, payload: Mapping, timeout_s: float) -> Attempt:
    """One POST /generate, classified. Never raises for HTTP or network trouble."""
    try:
        async with session.post(url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            text = await resp.text()
            try:
                body = await resp.json(content_type=None) if text else None
            except ValueError:
                body = None
            result = classify_response(resp.status, body, text)
            return Attempt(result, body if result is AttemptResult.OK else None,
                           "" if result is AttemptResult.OK else f"HTTP {resp.status}: {text[:200]}")
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return Attempt(classify_exception(exc), None, f"{type(exc).__name__}: {exc}")


FailureSink = Callable[[float], None]  # e.g. WatchdogTask.record_failure
# Sends one attempt: (payload, timeout_s) -> Attempt. The default posts to the router.
Transport = Callable[[Mapping, float], Awaitable[Attempt]]


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

            async def transport(payload: Mapping, timeout_s: float) -> Attempt:
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
            outcome = await self._send(request, timeout)
            metrics.ROLLOUT_ATTEMPTS.labels(fleet=self.fleet, result=outcome.result.value).inc()
            if outcome.result is AttemptResult.OK:
                self._settle("ok", started)
                return outcome.body  # type: ignore[return-value]
            if self.on_failure is not None:
                self.on_failure(loop.time())
            step = next_step(self.policy, attempt, outcome.result, loop.time() - started, self.rng)
            if isinstance(step, GiveUp):
                self._settle(step.outcome, started)
                raise RolloutRequestFailed(sample_id, step.outcome, step.why, outcome.result, outcome.detail)
            log.debug("sample %s attempt %d: %s; retrying in %.2f s", sample_id, attempt, outcome.detail, step.delay_s)
            await asyncio.sleep(step.delay_s)

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
