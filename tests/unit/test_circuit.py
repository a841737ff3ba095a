"""The rollout circuit to the router: the pure state machine, and the client's use of it (looptime)."""
from __future__ import annotations

import asyncio
import random

import pytest

from rlfleet.crds.specs import RecoverySpec
from rlfleet.orchestrator.rollout.client import CIRCUIT_OPEN, RetryPolicy, RolloutClient, RolloutRequestFailed
from rlfleet.policy.circuit import Admission, CircuitBreaker, CircuitSettings, CircuitState
from rlfleet.policy.recovery import RouterGiveUp, RouterRestart, plan_router_restart
from rlfleet.sglang.errors import FailureKind, error_for

SETTINGS = CircuitSettings(threshold=3, open_base_s=0.5, open_max_s=4.0)


def test_opens_after_threshold_consecutive_refusals_not_before():
    circuit = CircuitBreaker(SETTINGS)
    assert not circuit.record_failure(0.0) and not circuit.record_failure(0.1)
    assert circuit.admit(0.1) is Admission.SEND
    assert circuit.record_failure(0.2)  # the third in a row opens it
    assert circuit.state is CircuitState.OPEN and circuit.opened == 1
    assert circuit.admit(0.3) is Admission.REJECT


def test_a_success_between_refusals_keeps_it_closed():
    circuit = CircuitBreaker(SETTINGS)
    for t in range(10):
        circuit.record_failure(t)
        circuit.record_failure(t + 0.5)
        circuit.record_success()
    assert circuit.state is CircuitState.CLOSED and circuit.opened == 0


def test_half_open_admits_exactly_one_probe_and_backs_off_while_it_fails():
    circuit = CircuitBreaker(SETTINGS)
    for _ in range(3):
        circuit.record_failure(0.0)
    retry_times = []
    now = 0.0
    for _ in range(6):
        now = circuit.retry_at
        retry_times.append(now)
        assert circuit.admit(now - 0.01) is Admission.REJECT
        assert circuit.admit(now) is Admission.PROBE
        assert circuit.admit(now) is Admission.REJECT  # one probe at a time
        circuit.probe_result(False, now)
    gaps = [b - a for a, b in zip([0.0, *retry_times], retry_times, strict=False)]
    assert gaps == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]  # doubling, capped
    circuit.probe_result(True, now)
    assert circuit.state is CircuitState.CLOSED and circuit.admit(now) is Admission.SEND
    for _ in range(3):
        circuit.record_failure(now)
    assert circuit.retry_at == now + 0.5  # a fresh outage starts from the first period again


@pytest.mark.parametrize("bad", [dict(threshold=0), dict(open_base_s=0), dict(open_base_s=2, open_max_s=1)])
def test_bad_settings_are_rejected(bad):
    with pytest.raises(ValueError):
        CircuitSettings(**bad)


def test_router_restarts_are_immediate_then_back_off_within_the_budget():
    spec = RecoverySpec(backoff_base_seconds=1, backoff_max_seconds=4)
    plans = [plan_router_restart(n, max_restarts=5, spec=spec) for n in range(6)]
    assert plans[:5] == [RouterRestart(0.0, 1), RouterRestart(1.0, 2), RouterRestart(2.0, 3), RouterRestart(4.0, 4),
                         RouterRestart(4.0, 5)]
    assert isinstance(plans[5], RouterGiveUp) and "5 per run" in plans[5].why
    assert isinstance(plan_router_restart(0, max_restarts=0, spec=spec), RouterGiveUp)


class RouterPath:
    """A router that refuses connections until `up_at`, then answers."""

    def __init__(self, up_at: float):
        self.up_at = up_at
        self.sent: list[float] = []
        self.probes: list[float] = []

    def up(self) -> bool:
        return asyncio.get_running_loop().time() >= self.up_at

    async def send(self, payload, timeout_s):
        self.sent.append(asyncio.get_running_loop().time())
        if not self.up():
            await asyncio.sleep(0.001)
            raise error_for(FailureKind.CONNECTION_REFUSED, "Connect call failed")
        await asyncio.sleep(1.0)  # a generation
        return {"text": "x", "meta_info": {"id": payload["rid"], "finish_reason": {"type": "length"}}}

    async def probe(self, timeout_s):
        self.probes.append(asyncio.get_running_loop().time())
        return self.up()


async def keep_busy(client: RolloutClient, workers: int, until: float) -> tuple[int, int]:
    """Like the producer: workers send samples back to back until `until`. (answered, failed)"""
    loop = asyncio.get_running_loop()
    answered = failed = 0

    async def worker(w: int) -> None:
        nonlocal answered, failed
        n = 0
        while loop.time() < until:
            n += 1
            try:
                await client.generate(f"w{w}-{n}", {"text": "hi"})
                answered += 1
            except RolloutRequestFailed:
                failed += 1

    async with asyncio.TaskGroup() as group:
        for w in range(workers):
            group.create_task(worker(w))
    return answered, failed


@pytest.mark.looptime
async def test_a_dead_router_costs_a_handful_of_requests_a_second_and_the_watchdog_still_counts():
    path = RouterPath(up_at=60.0)
    counted: list[float] = []
    client = RolloutClient("http://router", None, transport=path.send, probe=path.probe, on_failure=counted.append,
                           policy=RetryPolicy(max_attempts=4), rng=random.Random(0), fleet="circuit-test")
    answered, failed = await keep_busy(client, workers=64, until=70.0)
    sent_while_down = [t for t in path.sent if t < 60.0]
    # 64 workers back to back: hundreds of attempts a second without the circuit, a handful with it.
    assert len(sent_while_down) < 64 + 60 * 3, len(sent_while_down)
    assert len(path.probes) <= 60 / 0.5
    # Every attempt that was not sent still reached the watchdog: far above its default limit per window.
    counted_while_down = [t for t in counted if t < 60.0]
    assert len(counted_while_down) > 20 * len(sent_while_down)
    assert client.attempts[CIRCUIT_OPEN] > 0
    # Once the router answers again, the circuit closes within its longest open period and samples flow.
    first_ok = min(t for t in path.sent if t >= 60.0)
    assert first_ok <= 60.0 + SETTINGS.open_max_s + 1
    assert answered > 0 and client.circuit.state is CircuitState.CLOSED


@pytest.mark.looptime
async def test_a_cancelled_probe_does_not_leave_the_circuit_half_open():
    async def refuse(payload, timeout_s):
        raise error_for(FailureKind.CONNECTION_REFUSED, "refused")

    async def hanging_probe(timeout_s):
        await asyncio.sleep(3600)
        return True

    client = RolloutClient("http://router", None, transport=refuse, probe=hanging_probe, fleet="circuit-test",
                           policy=RetryPolicy(max_attempts=100, backoff_max_s=1))
    task = asyncio.create_task(client.generate("s", {"text": "hi"}))
    await asyncio.sleep(30)
    assert client.circuit.state is CircuitState.HALF_OPEN
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert client.circuit.state is CircuitState.OPEN


@pytest.mark.looptime
async def test_connect_timeouts_open_the_circuit_like_refusals_but_answer_timeouts_do_not():
    import aiohttp

    def timeout(connecting: bool):
        error = error_for(FailureKind.TIMEOUT, "timed out")
        error.__cause__ = aiohttp.ConnectionTimeoutError() if connecting else TimeoutError()
        return error

    for connecting, opens in ((True, True), (False, False)):
        async def send(payload, timeout_s, connecting=connecting):
            raise timeout(connecting)

        client = RolloutClient("http://router", None, transport=send, fleet="circuit-test",
                               policy=RetryPolicy(max_attempts=10, backoff_base_s=0.1, backoff_max_s=0.1))
        with pytest.raises(RolloutRequestFailed):
            await client.generate("s", {"text": "hi"})
        assert (client.circuit.opened == 1) is opens


@pytest.mark.looptime
async def test_a_probe_that_ends_past_the_deadline_gives_up_at_it_sending_nothing_more():
    """The router answers the circuit's probe, but only after the request's deadline: the request fails as
    one past its deadline, and no attempt is sent with what was left before the probe."""
    sent: list[float] = []

    async def refuse(payload, timeout_s):
        assert timeout_s > 0  # what the HTTP call requires
        sent.append(asyncio.get_running_loop().time())
        raise error_for(FailureKind.CONNECTION_REFUSED, "refused")

    async def late_probe(timeout_s):
        await asyncio.sleep(timeout_s)  # answers at its bound
        return True

    client = RolloutClient("http://router", None, transport=refuse, probe=late_probe, fleet="circuit-test",
                           circuit=CircuitBreaker(CircuitSettings(threshold=1, open_base_s=0.5, open_max_s=0.5)),
                           policy=RetryPolicy(max_attempts=100, backoff_base_s=0.1, backoff_max_s=0.1, deadline_s=1.5),
                           rng=random.Random(0))
    with pytest.raises(RolloutRequestFailed) as info:
        await client.generate("s", {"text": "hi"})
    assert info.value.outcome == "deadline" and "deadline of 1.5 s reached" in str(info.value)
    assert sent == [0.0]  # the refusal that opened the circuit; none after the probe
    assert client.circuit.state is CircuitState.CLOSED  # the probe's answer still counts
