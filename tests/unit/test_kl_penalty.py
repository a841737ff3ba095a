"""The KL penalty to the reference policy: the k3 estimator and how it enters the GRPO loss."""
from __future__ import annotations

import pytest
import torch

from rlfleet.trainer import grpo
from rlfleet.trainer.grpo import LossConfig


def random_batch(seed: int = 0, batch: int = 4, length: int = 6):
    gen = torch.Generator().manual_seed(seed)
    new = torch.randn(batch, length, generator=gen) - 2.0
    old = new + 0.1 * torch.randn(batch, length, generator=gen)
    ref = new + 0.5 * torch.randn(batch, length, generator=gen)
    adv = torch.randn(batch, generator=gen)
    mask = (torch.rand(batch, length, generator=gen) > 0.3).float()
    mask[:, 0] = 1.0
    return new, old, ref, adv, mask


# --- the estimator ------------------------------------------------------------------------------------

def test_k3_is_zero_where_policy_and_reference_agree():
    logp = torch.tensor([-0.1, -2.0, -7.5])
    assert grpo.k3_kl(logp, logp.clone()).tolist() == [0.0, 0.0, 0.0]


def test_k3_is_positive_wherever_they_differ():
    logp = torch.tensor([-1.0, -1.0, -3.0, -0.2])
    ref = torch.tensor([-0.5, -2.0, -0.1, -0.3])
    assert (grpo.k3_kl(logp, ref) > 0).all()


def test_k3_expectation_under_the_policy_is_the_exact_kl():
    # sum_x p(x) k3(x) = sum q - sum p log(q/p) - 1 = KL(p || q) for distributions p, q.
    p = torch.log_softmax(torch.tensor([2.0, 0.5, -1.0, 0.0]), -1)
    q = torch.log_softmax(torch.tensor([0.0, 1.0, 0.3, -2.0]), -1)
    expected = (p.exp() * grpo.k3_kl(p, q)).sum()
    exact = (p.exp() * (p - q)).sum()
    assert expected.item() == pytest.approx(exact.item(), rel=1e-5)
    assert exact.item() > 0.1


# --- in the loss --------------------------------------------------------------------------------------

def test_kl_coef_zero_is_exactly_the_old_loss():
    new, old, ref, adv, mask = random_batch()
    a = new.clone().requires_grad_(True)
    b = new.clone().requires_grad_(True)
    base_loss, base_stats = grpo.policy_loss(a, old, adv, mask, LossConfig())
    off_loss, off_stats = grpo.policy_loss(b, old, adv, mask, LossConfig(kl_coef=0.0), ref_logprobs=ref)
    base_loss.backward()
    off_loss.backward()
    assert torch.equal(off_loss, base_loss)
    assert torch.equal(a.grad, b.grad)
    assert off_stats == base_stats
    assert "kl_ref" not in off_stats
    # ... and the old loss is the clipped policy-gradient token mean, written out here.
    ratio = torch.exp((new - old) * mask)
    per_token = -torch.minimum(ratio * adv[:, None], torch.clamp(ratio, 0.8, 1.2) * adv[:, None])
    assert base_loss.item() == pytest.approx(((per_token * mask).sum() / mask.sum()).item(), rel=1e-6)


def test_penalty_adds_kl_coef_times_the_token_mean_of_k3():
    new, old, ref, adv, mask = random_batch(seed=1)
    plain, _ = grpo.policy_loss(new, old, adv, mask, LossConfig())
    penalised, stats = grpo.policy_loss(new, old, adv, mask, LossConfig(kl_coef=0.3), ref_logprobs=ref)
    k3_mean = ((grpo.k3_kl(new, ref) * mask).sum() / mask.sum()).item()
    assert stats["kl_ref"] == pytest.approx(k3_mean, rel=1e-6)
    assert stats["kl_ref"] > 0
    assert penalised.item() == pytest.approx(plain.item() + 0.3 * k3_mean, rel=1e-6)


def test_penalty_gradient_points_each_token_back_to_the_reference():
    # No advantage: only the penalty acts. Descent lowers tokens the policy over-weights relative
    # to the reference and raises the ones it under-weights.
    new = torch.tensor([[-0.5, -3.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -1.0]])
    loss, stats = grpo.policy_loss(new, new.detach(), torch.zeros(1), torch.ones(1, 3), LossConfig(kl_coef=1.0),
                                   ref_logprobs=ref)
    loss.backward()
    grad = new.grad[0]
    assert grad[0] > 0 and grad[1] < 0 and grad[2] == 0
    assert grad.tolist() == pytest.approx(((1 - torch.exp(ref - new.detach())) / 3)[0].tolist(), rel=1e-6)


def drift_back(kl_coef: float, steps: int = 50) -> tuple[float, float]:
    """A categorical policy drifted from its reference, trained on samples of itself with zero advantage:
    the exact KL before and after."""
    gen = torch.Generator().manual_seed(0)
    ref_logits = torch.randn(8, generator=gen)
    logits = (ref_logits + 2.5 * torch.randn(8, generator=gen)).requires_grad_(True)
    ref = torch.log_softmax(ref_logits, -1)

    def exact_kl() -> float:
        logp = torch.log_softmax(logits.detach(), -1)
        return float((logp.exp() * (logp - ref)).sum())

    before = exact_kl()
    optimizer = torch.optim.SGD([logits], lr=0.5)
    for _ in range(steps):
        logp = torch.log_softmax(logits, -1)
        tokens = torch.multinomial(logp.detach().exp(), 64, replacement=True, generator=gen)[None]
        new = logp[tokens]
        loss, _ = grpo.policy_loss(new, new.detach(), torch.zeros(1), torch.ones_like(new),
                                   LossConfig(kl_coef=kl_coef), ref_logprobs=ref[tokens])
        optimizer.zero_grad()
        loss.backward()
        if logits.grad is not None:
            optimizer.step()
    return before, exact_kl()


def test_penalty_pulls_a_drifted_policy_back_to_the_reference():
    before, after = drift_back(kl_coef=1.0)
    assert before > 0.5
    assert after < 0.1 * before
    # Without the penalty nothing moves it.
    before_off, after_off = drift_back(kl_coef=0.0)
    assert after_off == pytest.approx(before_off)


def test_micro_batches_add_up_with_the_penalty_on():
    new, old, ref, adv, mask = random_batch(seed=2)
    config = LossConfig(kl_coef=0.5)
    full, _ = grpo.policy_loss(new, old, adv, mask, config, ref_logprobs=ref)
    total = float(mask.sum())
    parts = sum(grpo.policy_loss(new[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], config,
                                 normaliser=total, ref_logprobs=ref[i:i + 2])[0] for i in (0, 2))
    assert parts.item() == pytest.approx(full.item(), rel=1e-6)


def test_padding_does_not_reach_the_penalty():
    new = torch.tensor([[-1.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -500.0]])  # padding position: garbage that would overflow exp()
    loss, stats = grpo.policy_loss(new, new.detach(), torch.zeros(1), torch.tensor([[1.0, 0.0]]),
                                   LossConfig(kl_coef=1.0), ref_logprobs=ref)
    loss.backward()
    assert torch.isfinite(loss) and loss.item() == 0.0
    assert new.grad.tolist() == [[0.0, 0.0]]
    assert stats["kl_ref"] == 0.0


def test_penalty_without_reference_logprobs_is_an_error():
    new, old, _, adv, mask = random_batch()
    with pytest.raises(ValueError, match="reference log-probs"):
        grpo.policy_loss(new, old, adv, mask, LossConfig(kl_coef=0.1))


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_kl_coef_must_be_finite_and_not_negative(bad):
    with pytest.raises(ValueError, match="kl_coef"):
        LossConfig(kl_coef=bad)
