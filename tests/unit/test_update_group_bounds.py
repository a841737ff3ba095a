"""The whole broadcast transfer (begin .. end) is bounded by the transfer timeout, on fake engines and a
fake rank 0: a step late in the transfer gets only what is left, and who did not answer then is wedged."""
from __future__ import annotations

import asyncio
import time

import pytest

from rlfleet.orchestrator.fleet import broadcast_plan as plan
from rlfleet.orchestrator.fleet.update_group import Member, TransferFailed, UpdateGroup


class FakeRankZero:
    def __init__(self, fill_s: float = 0.0):
        self.fill_s = fill_s
        self.killed = False

    def fill(self, buckets, tensors) -> None:  # in a thread, as the real copy
        time.sleep(self.fill_s)

    async def broadcast(self, start: int, end: int, timeout_s: float) -> float:
        return 0.0


class FakeEngine:
    """Answers every call after `delay_s` (slot `stuck` never answers a bucket)."""

    def __init__(self, delay_s: float, stuck: bool = False):
        self.delay_s, self.stuck = delay_s, stuck
        self.bucket_timeouts: list[float] = []

    async def begin_weight_update(self, timeout_s: float) -> tuple[bool, str]:
        return True, ""

    async def end_weight_update(self, timeout_s: float) -> tuple[bool, str]:
        return True, ""

    async def update_weights_from_distributed(self, *, timeout_s: float, **_: object) -> tuple[bool, str]:
        self.bucket_timeouts.append(timeout_s)
        await asyncio.sleep(3600 if self.stuck else self.delay_s)
        return True, ""


def group_of(engines: dict[str, FakeEngine], rank_zero: FakeRankZero, transfer_timeout_s: float,
             n_buckets: int) -> UpdateGroup:
    specs = [plan.TensorSpec(f"t{i}", "float32", (256,), 1024) for i in range(n_buckets)]
    buckets = plan.plan_buckets(specs, 1024)
    members = [Member(slot, 0, url, slot + 1) for slot, url in enumerate(engines)]
    return UpdateGroup(members, (), rank_zero, group_name="g", backend="gloo", buckets=buckets,  # type: ignore[arg-type]
                       bounds=plan.StepBounds(transfer_timeout_s), client=lambda url: engines[url])  # type: ignore[arg-type,return-value]


async def test_each_bucket_in_time_but_the_whole_transfer_late_wedges_who_had_not_answered():
    # T = 2 s: each bucket's own bound is 2 s, and 0.75 s meets it; three of them do not fit in 2 s.
    engines = {"a": FakeEngine(0.75), "b": FakeEngine(0.0)}
    group = group_of(engines, FakeRankZero(), 2.0, 3)
    started = time.monotonic()
    with pytest.raises(TransferFailed, match="bucket 3/3") as caught:
        await group.transfer({}, "v")
    assert time.monotonic() - started < 3.5  # ended at the third bucket (2.25 s of work), not after it
    assert caught.value.wedged == (0,) and caught.value.gone == ()
    assert group.broken
    first, second, third = engines["a"].bucket_timeouts
    assert first == pytest.approx(2.0, abs=0.3)
    assert second <= 2.0 - 0.75 and third <= 2.0 - 2 * 0.75  # what was left of the transfer


async def test_a_transfer_that_fits_its_bound_succeeds():
    engines = {"a": FakeEngine(0.05), "b": FakeEngine(0.05)}
    times = await group_of(engines, FakeRankZero(), 1.0, 3).transfer({}, "v")
    assert times.buckets == 3 and len(times.per_bucket_s) == 3


async def test_a_transfer_whose_copies_took_its_bound_blames_no_engine():
    engines = {"a": FakeEngine(0.0)}
    group = group_of(engines, FakeRankZero(fill_s=1.1), 1.0, 1)
    with pytest.raises(TransferFailed, match="bucket 1/1: the transfer took its whole bound") as caught:
        await group.transfer({}, "v")
    assert caught.value.wedged == () and caught.value.gone == () and group.broken
    assert engines["a"].bucket_timeouts == []  # no engine was asked for a bucket it had no time for


async def test_a_stuck_engine_costs_its_bucket_bound_and_is_named():
    engines = {"a": FakeEngine(0.0), "b": FakeEngine(0.0, stuck=True)}
    group = group_of(engines, FakeRankZero(), 1.0, 1)
    with pytest.raises(TransferFailed, match="bucket 1/1") as caught:
        await group.transfer({}, "v")
    assert caught.value.wedged == (1,)
