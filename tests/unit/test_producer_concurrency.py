"""The producer's groups in flight follow a scaled fleet (`set_concurrency`): more at once, and fewer once the
groups under way have finished, none cut short. The client is a stand-in that answers when told to (no I/O)."""
from __future__ import annotations

import asyncio
import itertools

from rlfleet.orchestrator.rollout.producer import RolloutProducer, SamplingSettings


class HeldClient:
    """generate() answers only when `release()` lets one through; counts requests waiting."""

    def __init__(self) -> None:
        self.waiting = 0
        self._gate = asyncio.Semaphore(0)

    async def generate(self, request_id: str, payload: dict) -> dict:
        self.waiting += 1
        try:
            await self._gate.acquire()
        finally:
            self.waiting -= 1
        return {"text": "x", "output_ids": [7], "meta_info": {"output_token_logprobs": [[-0.5, 7, None]],
                                                          "weight_version": "1"}}

    def release(self, n: int) -> None:
        for _ in range(n):
            self._gate.release()


async def settle(condition) -> None:
    """Until `condition()` holds (the test fails after 2 s)."""
    async with asyncio.timeout(2.0):
        for _ in itertools.count():
            if condition():
                return
            await asyncio.sleep(0.01)


async def test_groups_in_flight_follow_the_fleets_size_without_cutting_a_group_short():
    client = HeldClient()
    producer = RolloutProducer(client, itertools.repeat(("p", "a")), lambda p, t, a: 1.0, lambda text: [1, 2],
                               samples_per_prompt=1, sampling=SamplingSettings(), concurrency=1, queue_groups=100)
    producer.start()
    try:
        await settle(lambda: client.waiting == 1)
        producer.set_concurrency(3)  # scaled up: two more groups at once
        await settle(lambda: client.waiting == 3)

        producer.set_concurrency(1)  # scaled down: the three under way finish, then one at a time
        await asyncio.sleep(0.05)
        assert client.waiting == 3
        client.release(3)
        await settle(lambda: producer.stats.groups_done == 3 and client.waiting == 1)
        await asyncio.sleep(0.05)
        assert client.waiting == 1 and producer.stats.groups_failed == 0

        producer.set_concurrency(2)  # and up again
        await settle(lambda: client.waiting == 2)
        assert producer.queue.qsize() == 3
    finally:
        client.release(100)
        await producer.stop()
