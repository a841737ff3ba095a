"""Rollouts with the torch trainer's own `generate`: no engines, for measurements and tuning.

The RL loop proper samples with SGLang; this produces the same `Sample`s (sampling logprobs under
the sampling temperature, weight version = the trainer's step) from inside the trainer process.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlfleet.trainer import grpo
from rlfleet.trainer.tasks import Problem, RewardFn


@dataclass(frozen=True)
class SamplingSettings:
    group_size: int = 8
    max_new_tokens: int = 4
    temperature: float = 1.0


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def decode_response(tokenizer: Any, response_ids: Sequence[int]) -> str:
    return tokenizer.decode(list(response_ids), skip_special_tokens=True)


def rollout_groups(
    trainer: Any,
    tokenizer: Any,
    problems: Sequence[Problem],
    settings: SamplingSettings,
    reward_fn: RewardFn,
) -> list[list[grpo.Sample]]:
    """`group_size` samples per problem, scored by reward_fn; one group per problem."""
    import torch

    eos = tokenizer.eos_token_id
    version = str(trainer.step)
    groups = []
    for index, problem in enumerate(problems):
        prompt_ids = encode_prompt(tokenizer, problem.prompt)
        prompt = torch.tensor([prompt_ids], dtype=torch.long, device=trainer.device)
        sequences = trainer.hf_generate(
            prompt,
            do_sample=True,
            temperature=settings.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=settings.max_new_tokens,
            num_return_sequences=settings.group_size,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
        )
        responses = [_until_eos(row[len(prompt_ids):].tolist(), eos) for row in sequences]
        logprobs = _sampling_logprobs(trainer, prompt_ids, responses, settings.temperature)
        group = []
        for response, lps in zip(responses, logprobs, strict=True):
            text = decode_response(tokenizer, response)
            group.append(
                grpo.Sample(
                    prompt_ids=tuple(prompt_ids),
                    response_ids=tuple(response),
                    sampling_logprobs=tuple(lps),
                    weight_version=version,
                    reward=float(reward_fn(problem.prompt, text, problem.answer)),
                    group_id=f"{version}-{index}",
                )
            )
        groups.append(group)
    return groups


def _until_eos(ids: list[int], eos: int | None) -> list[int]:
    """The response as an engine reports it: up to and including EOS, no padding."""
    if eos is not None and eos in ids:
        return ids[: ids.index(eos) + 1]
    return ids


def _sampling_logprobs(trainer: Any, prompt_ids: list[int], responses: list[list[int]],
                       temperature: float) -> list[list[float]]:
    """log p(token) under logits / temperature, as SGLang reports them."""
    samples = [
        grpo.Sample(tuple(prompt_ids), tuple(r), tuple(0.0 for _ in r), "0") for r in responses
    ]
    batch = grpo.collate(samples, pad_id=trainer.pad_id, device=trainer.device)
    logits = trainer.logits(batch.input_ids)
    lp = grpo.token_logprobs(logits, batch.input_ids.cpu(), temperature)
    start = len(prompt_ids) - 1
    return [lp[i, start : start + len(r)].tolist() for i, r in enumerate(responses)]


def greedy_scores(trainer: Any, tokenizer: Any, problems: Sequence[Problem], max_new_tokens: int,
                  reward_fn: RewardFn) -> float:
    """Mean reward of greedy answers (temperature 0): the eval figure."""
    import torch

    total = 0.0
    for problem in problems:
        prompt_ids = encode_prompt(tokenizer, problem.prompt)
        prompt = torch.tensor([prompt_ids], dtype=torch.long, device=trainer.device)
        out = trainer.hf_generate(
            prompt, do_sample=False, max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )
        response = _until_eos(out[0, len(prompt_ids):].tolist(), tokenizer.eos_token_id)
        total += reward_fn(problem.prompt, decode_response(tokenizer, response), problem.answer)
    return total / len(problems)
