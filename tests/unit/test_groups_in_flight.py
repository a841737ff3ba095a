"""spec.rollout.concurrencyPerEngine counts rollout requests (Miles' --sglang-server-concurrency); the producer
generates whole groups, so it keeps as many groups in flight as fill that many requests per engine."""
from __future__ import annotations

from rlfleet.orchestrator.rollout.producer import groups_in_flight


def groups(requests_per_engine: int, engines: int, samples_per_prompt: int, prompts_per_step: int) -> int:
    return groups_in_flight(requests_per_engine=requests_per_engine, engines=engines,
                            samples_per_prompt=samples_per_prompt, prompts_per_step=prompts_per_step)


def test_requests_per_engine_times_engines_in_whole_groups():
    assert groups(64, 2, 16, 16) == 8  # 128 requests: 8 groups of 16, not 16 groups (256 requests)
    assert groups(4, 2, 4, 4) == 2
    assert groups(10, 3, 4, 100) == 7  # 30 requests: 7 whole groups (28 requests)


def test_never_more_than_one_steps_groups():
    assert groups(4096, 8, 1, 16) == 16


def test_at_least_one_group_even_if_larger_than_the_limit():
    assert groups(1, 1, 16, 16) == 1
