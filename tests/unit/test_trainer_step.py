"""A real train step of each backend on the tiny model moves probability toward positive advantages."""
from __future__ import annotations

import pytest
import torch

from helpers.engines import on_policy_batch
from rlfleet.trainer import grpo
from rlfleet.trainer.base import build_trainer

PROMPT = list(b"abc=")
GOOD, BAD = list(b"bcd"), list(b"xyz")


def response_logprob(trainer, response) -> float:
    ids = torch.tensor([PROMPT + response])
    return grpo.token_logprobs(trainer.logits(ids), ids)[0, len(PROMPT) - 1:].sum().item()


def batch(trainer) -> list[grpo.Sample]:
    """One on-policy group that rewards GOOD over BAD."""
    return on_policy_batch(trainer, PROMPT, [(GOOD, 1.0), (BAD, 0.0)])


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_train_steps_follow_the_advantages(backend, tiny_model):
    trainer = build_trainer(backend, tiny_model, lr=1e-2, seed=0, micro_batch_size=1)
    good, bad = response_logprob(trainer, GOOD), response_logprob(trainer, BAD)
    exported = trainer.state_for_export()
    for _ in range(3):
        metrics = trainer.train_step(batch(trainer))
    assert trainer.step == 3
    assert metrics["tokens"] == 6 and metrics["samples"] == 2 and metrics["grad_norm"] > 0
    assert response_logprob(trainer, GOOD) > good + 1.0
    assert response_logprob(trainer, BAD) < bad - 1.0
    # The exported copy belongs to the caller: training on does not change it.
    again = trainer.state_for_export()
    assert exported.step == 0 and again.step == 3
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(exported.tensors[name], again.tensors[name])
    assert "lm_head.weight" not in again.tensors  # tied to the embeddings


def test_empty_batch_is_refused(tiny_model):
    trainer = build_trainer("torch", tiny_model, lr=1e-3)
    with pytest.raises(ValueError, match="at least one sample"):
        trainer.train_step([])


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_an_export_into_the_broadcast_buffer_leaves_the_fill_nothing_to_copy(backend, tiny_model, monkeypatch):
    """The weights exported into the views of a broadcast's shared buffer are the trainer's weights, in
    the bucket layout the engines receive; `fill` then copies none of them (and any other tensor still)."""
    from rlfleet.orchestrator.fleet import broadcast_plan as plan
    from rlfleet.orchestrator.fleet.broadcaster import Broadcaster

    trainer = build_trainer(backend, tiny_model, lr=1e-2, seed=0)
    trainer.train_step(batch(trainer))
    fresh = trainer.state_for_export().tensors
    buckets = plan.plan_buckets(plan.tensor_specs(fresh), 64 * 1024)
    assert len(buckets) > 1
    broadcaster = Broadcaster(plan.buffer_bytes(buckets))
    broadcaster.buffer = torch.zeros(broadcaster.nbytes, dtype=torch.uint8)  # as start() maps it, no process
    views = broadcaster.views(buckets)
    skipped = "model.norm.weight"
    exported = trainer.state_for_export({n: v for n, v in views.items() if n != skipped}).tensors
    assert set(exported) == set(fresh)
    for name, tensor in exported.items():
        assert torch.equal(tensor, fresh[name]), name
        assert (tensor.data_ptr() == views[name].data_ptr()) is (name != skipped), name

    copies: list[int] = []
    real_copy = torch.Tensor.copy_

    def counted_copy(self, src, *args, **kwargs):
        copies.append(src.numel() * src.element_size())
        return real_copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", counted_copy)
    broadcaster.fill(buckets, exported)  # only the one tensor not exported in place is copied
    monkeypatch.undo()
    assert copies == [fresh[skipped].nbytes]
    for bucket in buckets:  # the buffer: each bucket's tensors back to back, as SGLang reconstructs them
        offset = bucket.start
        for spec in bucket.tensors:
            raw = broadcaster.buffer[offset:offset + spec.nbytes]
            assert torch.equal(raw.view(fresh[spec.name].dtype).view(fresh[spec.name].shape), fresh[spec.name])
            offset += spec.nbytes
    mismatched = {skipped: torch.zeros(3)}  # another shape: a tensor of its own
    assert torch.equal(trainer.state_for_export(mismatched).tensors[skipped], fresh[skipped])


def test_a_pass_in_lockstep_beyond_the_replicas_micro_batches_changes_nothing(tiny_model, monkeypatch):
    """A replica whose part of the step has fewer micro-batches than the largest part (FSDP's replicas
    must run the same passes) makes up the difference with passes that contribute nothing: the step's
    loss, statistics and weights are those of its own micro-batches alone."""
    from rlfleet.trainer.torch_backend import TorchTrainer

    plain = build_trainer("torch", tiny_model, lr=1e-2, seed=0, micro_batch_size=1)
    padded = build_trainer("torch", tiny_model, lr=1e-2, seed=0, micro_batch_size=1)
    monkeypatch.setattr(TorchTrainer, "passes_in_lockstep", property(lambda self: self is padded))
    passes = []
    forward = padded._forward_logits
    monkeypatch.setattr(padded, "_forward_logits", lambda ids: passes.append(ids) or forward(ids))
    samples = batch(plain)
    ours, theirs = padded.train_step(samples, largest_part=4), plain.train_step(samples, largest_part=4)
    assert len(passes) == 4  # its 2 micro-batches and 2 more, as the largest part (4 samples) makes
    assert {k: v for k, v in ours.items() if k != "step_seconds"} == {
        k: v for k, v in theirs.items() if k != "step_seconds"}
    mine, other = padded.state_for_export().tensors, plain.state_for_export().tensors
    assert all(torch.equal(mine[k], other[k]) for k in other)


def test_fsdp_is_refused_where_it_would_shard_nothing(tiny_model):
    with pytest.raises(ValueError, match="spec.trainer.dataParallelMode fsdp .* dataParallelSize above 1"):
        build_trainer("torch", tiny_model, lr=1e-3, data_parallel_mode="fsdp")
    with pytest.raises(ValueError, match="data_parallel_mode must be one of ddp, fsdp"):
        build_trainer("torch", tiny_model, lr=1e-3, data_parallel_mode="zero3")
