"""The rollout request path: one sample -> POST {router}/generate, with bounded, classified retries.

Miles retries any error 60 times at a fixed 1 s, which turns a dead fleet into a 503 storm. Here:
- every attempt's result is classified; only what another try can fix is retried (503, connection
  refused or closed, timeout, 5xx, an abort answered as HTTP 200, a duplicate rid still being torn
  down); a 4xx is a bug in the request and fails at once;
- retries are few (`max_attempts`) with exponential backoff and full jitter, and the whole request has
  a deadline that no attempt or backoff sleep may cross;
- every failed attempt is timestamped into the 503 watchdog, which fails the run if they never stop;
- a circuit (rlfleet.policy.circuit) opens on consecutive refused connections: while the router is
  down no request is sent, one probe (`GET /health`) now and then tells when it is back, and the
  attempts that were not sent fail fast and still reach the watchdog, so its timing is unchanged;
- the sample's id is its rid on every attempt, so one engine never runs the same sample twice at once,
  and `generate()` returns at most one answer per sample: an attempt is cancelled (connection closed,
  which makes SGLang abort it) before the next one starts. `RolloutLedger` enforces exactly-once
  delivery across a batch;
- with `continuation` on, a request that gives its prompt as `input_ids` is streamed, so the client
  holds the tokens, behaviour logprobs and weight versions generated so far; when an attempt breaks
  (engine died or left the router, abort) the next attempt continues from them (prompt + prefix as
  `input_ids`, the remaining budget, the same sampling settings) and the answer is stitched
  (rlfleet.orchestrator.rollout.continuation). An attempt that generated tokens does not use up one of
  `max_attempts`: a continuation that breaks again is continued again while the deadline allows.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import aiohttp

from rlfleet.observability import metrics
from rlfleet.orchestrator.rollout.continuation import (
    Progress,
    continuation_request,
    prompt_ids_of,
    stitched_answer,
)
from rlfleet.orchestrator.rollout.stream import ChunkSink, stream_generate
from rlfleet.policy.circuit import Admission, CircuitBreaker, CircuitState
from rlfleet.sglang.engine import raise_if_aborted
from rlfleet.sglang.errors import CallError, CallTimeout, FailureKind
from rlfleet.sglang.http import call, expect_dict, is_connect_timeout

log = logging.getLogger(__name__)


OK = "ok"  # attempt label of a success; failures are labelled by their FailureKind
DUPLICATE_RID = "duplicate_rid"  # a 400 while the engine still holds the previous attempt of this sample
CIRCUIT_OPEN = "circuit_open"  # an attempt not sent because the circuit to the router is open
PROBE_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 10.0


class CircuitOpen(CallError):
    """An attempt that was not sent: the router refused the last connections and has not answered a
    probe since. Retryable like the refusal it stands for."""

    kind = FailureKind.CONNECTION_REFUSED

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
    if isinstance(error, CircuitOpen):
        return CIRCUIT_OPEN
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
        if self.attempt_timeout_s is not None and self.attempt_timeout_s <= 0:
            raise ValueError("attempt_timeout_s must be positive")


@dataclass(frozen=True)
class Retry:
    delay_s: float


@dataclass(frozen=True)
class GiveUp:
    outcome: str  # failed | deadline
    why: str


def attempt_timeout(policy: RetryPolicy, elapsed_s: float) -> float | None:
    """The bound of an attempt sent `elapsed_s` into its request: what is left of the deadline, capped by
    `attempt_timeout_s`; None when nothing is left (a backoff sleep or a circuit probe overran, or the loop
    lagged): the request has reached its deadline and the attempt is not sent."""
    left = policy.deadline_s - elapsed_s
    if left <= 0:
        return None
    return left if policy.attempt_timeout_s is None else min(left, policy.attempt_timeout_s)


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
    """One POST /generate: the answer, or the classified CallError (an abort in a 200 included). The
    connection itself must be made within CONNECT_TIMEOUT_S: a router that is gone without refusing
    (a blackholed pod address, a stopped process) fails attempts in seconds, not at the deadline."""
    reply = await call(session, "POST", url, timeout_s=timeout_s, json_body=dict(payload),
                       connect_timeout_s=min(CONNECT_TIMEOUT_S, timeout_s))
    return raise_if_aborted(reply, expect_dict(reply, "generate"))


FailureSink = Callable[[float], None]  # e.g. WatchdogTask.record_failure
# Sends one attempt: (payload, timeout_s) -> answer, raising CallError. The default posts to the router.
Transport = Callable[[Mapping, float], Awaitable[dict]]
# Probes an open circuit's path: (timeout_s) -> does the router answer? The default: GET {router}/health.
PathProbe = Callable[[float], Awaitable[bool]]
# Streams one attempt: (payload, timeout_s, on_chunk) -> the final chunk, raising CallError. The default
# streams from the router.
StreamTransport = Callable[[Mapping, float, ChunkSink], Awaitable[dict]]


@dataclass
class ContinuationStats:
    """What continuation saved, this client: requests continued, continuations, prefix tokens kept."""

    requests: int = 0
    continuations: int = 0
    tokens_saved: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"requests": self.requests, "continuations": self.continuations, "tokens_saved": self.tokens_saved}


async def probe_health(session: aiohttp.ClientSession, url: str, timeout_s: float) -> bool:
    """Does anything serve HTTP at `url` (any answer counts: the path is up)?"""
    try:
        await call(session, "GET", url, timeout_s=timeout_s)
    except CallError as exc:
        return exc.status is not None
    return True


class RolloutClient:
    """Sends samples to the router. `on_failure(t)` gets the loop time of every failed attempt."""

    def __init__(self, router_url: str, session: aiohttp.ClientSession | None, *,
                 policy: RetryPolicy | None = None, on_failure: FailureSink | None = None,
                 fleet: str = "rollout", rng: random.Random | None = None, transport: Transport | None = None,
                 circuit: CircuitBreaker | None = None, probe: PathProbe | None = None,
                 continuation: bool = False, stream: StreamTransport | None = None):
        self.generate_url = router_url.rstrip("/") + "/generate"
        if stream is None and session is not None:
            stream_url, stream_http = self.generate_url, session

            async def stream(payload: Mapping, timeout_s: float, on_chunk: ChunkSink) -> dict:
                return await stream_generate(stream_http, stream_url, payload, timeout_s, on_chunk,
                                             connect_timeout_s=CONNECT_TIMEOUT_S)
        if transport is None and session is None and stream is not None:
            streamed = stream

            async def transport(payload: Mapping, timeout_s: float) -> dict:  # one stream, its chunks joined
                progress = Progress.for_request(payload)
                try:
                    last = await streamed(payload, timeout_s, progress.apply_chunk)
                finally:
                    progress.end_attempt()
                return stitched_answer(last, progress)
        if transport is None and session is None:
            raise ValueError("RolloutClient needs an HTTP session, a transport or a stream")
        if transport is None:
            assert session is not None
            url, http = self.generate_url, session

            async def transport(payload: Mapping, timeout_s: float) -> dict:
                return await post_generate(http, url, payload, timeout_s)
        if probe is None and session is not None:
            health_url = router_url.rstrip("/") + "/health"

            async def probe(timeout_s: float) -> bool:
                return await probe_health(session, health_url, timeout_s)
        elif probe is None:  # a custom transport without a probe: the next attempt is the probe

            async def probe(timeout_s: float) -> bool:
                return True
        self._send = transport
        self._stream = stream
        self._probe = probe
        self.continuation = continuation and stream is not None
        self.continued = ContinuationStats()
        self.progress: dict[str, Progress] = {}  # sample id -> its output so far, while it is streamed
        self.policy = policy or RetryPolicy()
        self.on_failure = on_failure
        self.fleet = fleet
        self.rng = rng or random.Random()
        self.circuit = circuit or CircuitBreaker()
        self.attempts: collections.Counter[str] = collections.Counter()  # attempt label -> count, this client
        metrics.ROLLOUT_CIRCUIT_OPEN.labels(fleet=fleet).set(0)
        metrics.ROLLOUT_CIRCUIT_OPENS.labels(fleet=fleet)

    async def _admit(self, now: float) -> CallError | None:
        """None when the attempt may be sent; else the CircuitOpen error it fails with at once."""
        admission = self.circuit.admit(now)
        if admission is Admission.SEND:
            return None
        if admission is Admission.PROBE:
            ok = False
            try:
                ok = await self._probe(PROBE_TIMEOUT_S)
            finally:  # a cancelled probe is a failed one: the circuit never stays half-open
                loop = asyncio.get_running_loop()
                self.circuit.probe_result(ok, loop.time())
                metrics.ROLLOUT_CIRCUIT_PROBES.labels(fleet=self.fleet, result="ok" if ok else "failed").inc()
                self._circuit_gauge()
            if ok:
                log.info("rollout circuit to %s closed: the router answers again", self.generate_url)
                return None
        return CircuitOpen(f"circuit open: the router refused {self.circuit.settings.threshold} connections in a row "
                           f"and has not answered a probe since", method="POST", url=self.generate_url)

    def _note(self, error: CallError | None, now: float) -> None:
        """Tell the circuit what one sent attempt showed about the path."""
        if error is None or error.status is not None:
            self.circuit.record_success()  # the router answered (whatever it said): the path is up
        elif (error.kind is FailureKind.CONNECTION_REFUSED or is_connect_timeout(error)) and \
                self.circuit.record_failure(now):
            metrics.ROLLOUT_CIRCUIT_OPENS.labels(fleet=self.fleet).inc()
            log.warning("rollout circuit to %s opened after %d refused connections in a row; probing every "
                        "%.1f-%.1f s", self.generate_url, self.circuit.consecutive_failures,
                        self.circuit.settings.open_base_s, self.circuit.settings.open_max_s)
        self._circuit_gauge()

    def _circuit_gauge(self) -> None:
        metrics.ROLLOUT_CIRCUIT_OPEN.labels(fleet=self.fleet).set(0 if self.circuit.state is CircuitState.CLOSED else 1)

    async def generate(self, sample_id: str, payload: Mapping) -> dict:
        """The answer for one sample (its JSON body), or RolloutRequestFailed."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        request = {**payload, "rid": sample_id}
        prompt_ids = prompt_ids_of(payload) if self.continuation else None
        progress = None if prompt_ids is None else Progress.for_request(payload)
        if progress is not None:
            self.progress[sample_id] = progress
        attempt = 0  # the retry budget's count: an attempt that generated tokens resets it
        sent = 0  # attempts sent, for the message
        last: CallError | None = None
        try:
            while True:
                attempt += 1
                made = 0
                try:
                    refused = await self._admit(loop.time())
                    if refused is not None:
                        raise refused
                    # Measured once admitted: the probe of an open circuit takes time too.
                    timeout = attempt_timeout(self.policy, loop.time() - started)
                    if timeout is None:
                        deadline = f"deadline of {self.policy.deadline_s:g} s"
                        last = last or CallTimeout(f"no time left of the {deadline}", method="POST",
                                                   url=self.generate_url)
                        self._settle("deadline", started)
                        raise RolloutRequestFailed(sample_id, "deadline", f"{deadline} reached after {sent} "
                                                   f"attempts", last) from last
                    sent += 1
                    try:
                        if progress is None:
                            answer = await self._send(request, timeout)
                        else:
                            assert prompt_ids is not None
                            before = progress.generated
                            try:
                                answer = await self._send_continuing(request, prompt_ids, progress, timeout)
                            finally:
                                made = progress.generated - before
                    except CallError as sent_error:
                        self._note(sent_error, loop.time())
                        raise
                    self._note(None, loop.time())
                except CallError as error:
                    last = error
                    if progress is not None and (finish := progress.finished_without_engine()) is not None:
                        answer = stitched_answer(None, progress, finish=finish)  # broke after its last token
                        break
                    label = attempt_label(error)
                    self.attempts[label] += 1
                    metrics.ROLLOUT_ATTEMPTS.labels(fleet=self.fleet, result=label).inc()
                    if self.on_failure is not None:
                        self.on_failure(loop.time())
                    if made:  # it generated tokens: continuing them is progress, not another try
                        attempt = 0
                    step = next_step(self.policy, max(attempt, 1), error, loop.time() - started, self.rng)
                    if isinstance(step, GiveUp):
                        self._settle(step.outcome, started)
                        raise RolloutRequestFailed(sample_id, step.outcome, step.why, error) from error
                    log.debug("sample %s attempt %d failed (%s); retrying in %.2f s", sample_id, attempt, error,
                              step.delay_s)
                    await asyncio.sleep(step.delay_s)
                    continue
                break
        finally:
            self.progress.pop(sample_id, None)
        self.attempts[OK] += 1
        metrics.ROLLOUT_ATTEMPTS.labels(fleet=self.fleet, result=OK).inc()
        if progress is not None:
            self._count_continuations(progress)
        self._settle(OK, started)
        return answer

    async def _send_continuing(self, request: Mapping, prompt_ids: list[int], progress: Progress,
                               timeout_s: float) -> dict:
        """One streamed attempt, continuing whatever the earlier ones generated; the stitched answer."""
        assert self._stream is not None
        if progress.generated:
            request = continuation_request(request, prompt_ids, progress)
        try:
            last = await self._stream(request, timeout_s, progress.apply_chunk)
        finally:
            progress.end_attempt()
        return stitched_answer(last, progress)

    def _count_continuations(self, progress: Progress) -> None:
        continued = [s for s in progress.segments if s.start > 0]
        if not continued:
            return
        saved = sum(s.start for s in continued)
        self.continued.requests += 1
        self.continued.continuations += len(continued)
        self.continued.tokens_saved += saved
        metrics.ROLLOUT_CONTINUATIONS.labels(fleet=self.fleet).inc(len(continued))
        metrics.ROLLOUT_CONTINUATION_TOKENS_SAVED.labels(fleet=self.fleet).inc(saved)

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


async def generate_all(client: RolloutClient, samples: Mapping[str, Mapping], *,
                       concurrency: int = 64) -> RolloutLedger:
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
