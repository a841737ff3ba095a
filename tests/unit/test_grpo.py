"""GRPO math: advantages, staleness, batch assembly, SGLang answer parsing, collation, the clipped loss."""
from __future__ import annotations

import math

import pytest
import torch

from rlfleet.trainer import grpo
from rlfleet.trainer.grpo import LossConfig, Sample, StalenessPolicy


def sample(version: str = "0", reward: float = 0.0, prompt=(1, 2), response=(3, 4), group: str = "g") -> Sample:
    return Sample(prompt_ids=tuple(prompt), response_ids=tuple(response),
                  sampling_logprobs=tuple(-1.0 for _ in response), weight_version=version, reward=reward,
                  group_id=group)


# --- advantages ---------------------------------------------------------------------------------------

def test_group_advantages_are_normalised_within_the_group():
    adv = grpo.group_advantages([1.0, 0.0, 0.0, 1.0])
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)


def test_group_with_equal_rewards_has_no_signal():
    assert grpo.group_advantages([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]


def test_advantages_without_std_scaling_are_centred_rewards():
    assert grpo.group_advantages([1.0, 0.0, 0.5], scale_by_std=False) == pytest.approx([0.5, -0.5, 0.0])


def test_one_correct_sample_in_eight_gets_the_large_advantage():
    adv = grpo.group_advantages([1.0] + [0.0] * 7)
    assert adv[0] == pytest.approx(math.sqrt(7), rel=1e-4)
    assert adv[1] == pytest.approx(-1 / math.sqrt(7), rel=1e-4)


# --- staleness and batch assembly -------------------------------------------------------------------------

def test_staleness_counts_versions_behind_the_trainer():
    policy = StalenessPolicy(max_staleness=1)
    assert policy.staleness(sample("3"), current_step=5) == 2
    assert policy.is_fresh(sample("4"), current_step=5)
    assert not policy.is_fresh(sample("3"), current_step=5)


def test_version_ahead_of_the_trainer_is_an_error():
    with pytest.raises(ValueError, match="ahead of the trainer"):
        StalenessPolicy(1).staleness(sample("6"), current_step=5)


@pytest.mark.parametrize("bad", ["default", "", "1.5", "-1"])
def test_weight_versions_must_be_step_numbers(bad):
    with pytest.raises(ValueError, match="weight version"):
        grpo.parse_weight_version(bad)


def test_negative_staleness_bound_is_rejected():
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessPolicy(-1)


def test_assembly_drops_stale_groups_whole_and_counts_them():
    fresh = [sample("4", 1.0, group="a"), sample("4", 0.0, group="a")]
    mixed = [sample("4", 1.0, group="b"), sample("2", 0.0, group="b")]  # one sample too old
    flat = [sample("5", 0.5, group="c"), sample("5", 0.5, group="c")]
    batch = grpo.assemble_batch([fresh, mixed, flat], current_step=5, policy=StalenessPolicy(1))
    assert [s.group_id for s in batch.samples] == ["a", "a", "c", "c"]
    assert batch.groups == 2
    assert batch.stale_groups_rejected == 1
    assert batch.stale_samples_rejected == 2
    assert batch.zero_signal_groups == 1
    assert batch.versions == {"4": 2, "5": 2}
    assert batch.max_staleness_kept == 1
    assert batch.reward_mean == pytest.approx(0.5)
    assert [s.advantage for s in batch.samples] == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)


def test_on_policy_bound_keeps_only_the_current_version():
    groups = [[sample("5", 1.0), sample("5", 0.0)], [sample("4", 1.0), sample("4", 0.0)]]
    batch = grpo.assemble_batch(groups, current_step=5, policy=StalenessPolicy(0))
    assert batch.versions == {"5": 2}
    assert batch.stale_groups_rejected == 1


# --- SGLang /generate answers -----------------------------------------------------------------------------

def generate_answer(pairs, version="3", output_ids=None):
    body = {"text": "xy", "meta_info": {"weight_version": version, "output_token_logprobs": pairs,
                                        "finish_reason": {"type": "length"}}}
    if output_ids is not None:
        body["output_ids"] = output_ids
    return body


def test_sample_from_generate_reads_tokens_logprobs_and_version():
    body = generate_answer([[-0.5, 120, None], [-1.25, 121, None]], output_ids=[120, 121])
    s = grpo.sample_from_generate([97, 61], body, group_id="g1", reward=0.5)
    assert s.prompt_ids == (97, 61)
    assert s.response_ids == (120, 121)
    assert s.sampling_logprobs == (-0.5, -1.25)
    assert s.weight_version == "3"
    assert (s.reward, s.group_id) == (0.5, "g1")


def test_sample_from_generate_without_logprobs_says_so():
    with pytest.raises(ValueError, match="return_logprob"):
        grpo.sample_from_generate([1], {"meta_info": {"weight_version": "0"}})


def test_sample_from_generate_rejects_disagreeing_ids():
    with pytest.raises(ValueError, match="disagree"):
        grpo.sample_from_generate([1], generate_answer([[-0.5, 120, None]], output_ids=[7]))


def test_sample_needs_one_logprob_per_token():
    with pytest.raises(ValueError, match="logprobs"):
        Sample(prompt_ids=(1,), response_ids=(2, 3), sampling_logprobs=(-1.0,), weight_version="0")


# --- collation and loss -------------------------------------------------------------------------------------

def test_collate_aligns_logprobs_with_the_logits_that_predict_them():
    a = Sample((10, 11, 12), (20, 21), (-0.1, -0.2), "0", advantage=1.0)
    b = Sample((10,), (30,), (-0.3,), "0", advantage=-1.0)
    c = grpo.collate([a, b], pad_id=99)
    assert c.input_ids.tolist() == [[10, 11, 12, 20, 21], [10, 30, 99, 99, 99]]
    # Position t scores input_ids[:, t+1].
    assert c.response_mask.tolist() == [[0, 0, 1, 1], [1, 0, 0, 0]]
    assert c.old_logprobs.flatten().tolist() == pytest.approx([0, 0, -0.1, -0.2, -0.3, 0, 0, 0])
    assert c.advantages.tolist() == [1.0, -1.0]
    assert c.num_tokens == 3
    # What a data-parallel step counts for the whole batch without collating it.
    assert grpo.response_tokens([a, b]) == c.num_tokens == 3


def test_token_logprobs_apply_the_sampling_temperature():
    logits = torch.tensor([[[2.0, 0.0], [0.0, 0.0]]])
    ids = torch.tensor([[0, 0]])
    assert grpo.token_logprobs(logits, ids, 1.0).item() == pytest.approx(math.log(math.exp(2) / (math.exp(2) + 1)))
    assert grpo.token_logprobs(logits, ids, 2.0).item() == pytest.approx(math.log(math.e / (math.e + 1)))


def test_on_policy_loss_is_the_policy_gradient():
    new = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = new.detach().clone()
    mask = torch.ones(1, 2)
    loss, stats = grpo.policy_loss(new, old, torch.tensor([2.0]), mask, LossConfig())
    loss.backward()
    # ratio 1: d loss / d logp = -A / tokens
    assert new.grad[0].tolist() == pytest.approx([-1.0, -1.0])
    assert stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["clip_fraction"] == 0.0
    assert stats["kl_old_new"] == pytest.approx(0.0)


def test_ratio_beyond_the_clip_range_gives_no_gradient_in_the_clipped_direction():
    mask = torch.ones(1, 2)
    old = torch.zeros(1, 2)
    # Positive advantage, ratio 1.5 > 1.2: clipped, no further push up.
    new = torch.tensor([[math.log(1.5), 0.0]], requires_grad=True)
    loss, stats = grpo.policy_loss(new, old, torch.tensor([1.0]), mask, LossConfig(clip_low=0.2, clip_high=0.2))
    loss.backward()
    assert new.grad[0, 0].item() == 0.0
    assert new.grad[0, 1].item() == pytest.approx(-0.5)
    assert stats["clip_fraction"] == pytest.approx(0.5)
    # Negative advantage and ratio 1.5: not clipped (min picks the unclipped, worse term).
    new2 = torch.tensor([[math.log(1.5), 0.0]], requires_grad=True)
    loss2, _ = grpo.policy_loss(new2, old, torch.tensor([-1.0]), mask, LossConfig())
    loss2.backward()
    assert new2.grad[0, 0].item() == pytest.approx(1.5 / 2)


def test_padding_positions_do_not_count():
    new = torch.tensor([[-1.0, 50.0]], requires_grad=True)
    old = torch.tensor([[-1.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0]])
    loss, stats = grpo.policy_loss(new, old, torch.tensor([1.0]), mask, LossConfig())
    loss.backward()
    assert torch.isfinite(loss)
    assert new.grad[0, 1].item() == 0.0
    assert stats["tokens"] == 1.0
    assert stats["ratio_max"] == pytest.approx(1.0)


def test_micro_batches_add_up_to_the_full_batch_loss():
    torch.manual_seed(0)
    new = torch.randn(4, 5)
    old = new + 0.1 * torch.randn(4, 5)
    adv = torch.randn(4)
    mask = (torch.rand(4, 5) > 0.3).float()
    full, _ = grpo.policy_loss(new, old, adv, mask, LossConfig())
    total = float(mask.sum())
    parts = sum(grpo.policy_loss(new[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], LossConfig(),
                                 normaliser=total)[0] for i in (0, 2))
    assert parts.item() == pytest.approx(full.item(), rel=1e-6)


def test_loss_config_rejects_bad_settings():
    with pytest.raises(ValueError):
        LossConfig(clip_low=1.5)
    with pytest.raises(ValueError):
        LossConfig(temperature=0.0)
