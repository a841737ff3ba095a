"""klCoef on a real trainer (tiny model): the KL penalty keeps the policy near its initial weights."""
from __future__ import annotations

import pytest
import torch

from helpers.engines import on_policy_batch
from rlfleet.trainer import grpo
from rlfleet.trainer.base import build_trainer

PROMPT = list(b"abc=")
GOOD, BAD = list(b"bcd"), list(b"xyz")
RESPONSES = torch.tensor([PROMPT + GOOD, PROMPT + BAD])


def batch(trainer) -> list[grpo.Sample]:
    """One on-policy group that rewards GOOD over BAD."""
    return on_policy_batch(trainer, PROMPT, [(GOOD, 1.0), (BAD, 0.0)])


def response_distributions(trainer) -> torch.Tensor:
    """Log-probabilities over the vocabulary at every response position of GOOD and BAD."""
    return torch.log_softmax(trainer.logits(RESPONSES)[:, len(PROMPT) - 1:-1], -1)


def exact_kl(logp: torch.Tensor, ref: torch.Tensor) -> float:
    """KL(policy || initial) over the full vocabulary, mean over response positions."""
    return float((logp.exp() * (logp - ref)).sum(-1).mean())


def train(backend: str, model_dir, kl_coef: float, steps: int = 8):
    """KL to the initial model after `steps` rewarded steps, the step metrics, the trainer, the initial
    distributions."""
    trainer = build_trainer(backend, model_dir, lr=1e-2, seed=0, micro_batch_size=1,
                            loss=grpo.LossConfig(kl_coef=kl_coef))
    initial = response_distributions(trainer)
    history = [trainer.train_step(batch(trainer)) for _ in range(steps)]
    return exact_kl(response_distributions(trainer), initial), history, trainer, initial


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_kl_penalty_keeps_the_policy_near_the_initial_model(backend, tiny_model):
    free_kl, free_history, free, _ = train(backend, tiny_model, kl_coef=0.0)
    held_kl, held_history, held, initial = train(backend, tiny_model, kl_coef=10.0)
    # The reward alone drags the policy far from where it started; the penalty holds it close.
    assert free_kl > 1.0
    assert held_kl < 0.1 * free_kl
    # kl_ref is reported only with the penalty on: 0 on the first step (policy == reference), then > 0.
    assert all("kl_ref" not in m for m in free_history)
    assert held_history[0]["kl_ref"] == 0.0
    assert max(m["kl_ref"] for m in held_history[1:]) > 0
    # The reference is the initial model, frozen: no grad, eval mode, never trained.
    assert free.reference is None
    assert not any(p.requires_grad for p in held.reference.parameters())
    assert not held.reference.training
    with torch.no_grad():
        reference = torch.log_softmax(held._reference_logits(RESPONSES)[:, len(PROMPT) - 1:-1].float(), -1)
    assert torch.allclose(reference, initial, atol=1e-6)
