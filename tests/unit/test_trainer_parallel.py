"""The trainer's parallel layout: what it refuses before any rank starts, how it numbers and shards, and
how tensor-parallel shards split and join (pure, no torch.distributed)."""
from __future__ import annotations

import pytest
import torch

from rlfleet.crds.models import TrainerSpec
from rlfleet.trainer.hf_export import Architecture
from rlfleet.trainer.parallel import ParallelLayout, check_layout, layout_problems
from rlfleet.trainer.shards import ShardPlan, join_shards, split_for_rank

CONFIG = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320, "tie_word_embeddings": True,
}
TINY = Architecture.from_hf_config(CONFIG)


def test_world_is_tensor_times_pipeline_times_data():
    assert ParallelLayout(2, 1, 3).world == 6
    assert TrainerSpec(backend="megatron", gpus=6, tensor_parallel_size=2, data_parallel_size=3).world_size == 6


def test_ranks_are_numbered_tensor_fastest_then_data_then_stage():
    layout = ParallelLayout(tensor=2, pipeline=1, data=2)
    assert [layout.coords(r) for r in range(4)] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    with pytest.raises(ValueError, match="rank 4 is outside a world of 4"):
        layout.coords(4)


def test_data_shards_cover_the_batch_in_order():
    layout = ParallelLayout(data=3)
    batch = list(range(8))
    shards = [layout.data_shard(batch, r) for r in range(3)]
    assert shards == [[0, 1, 2], [3, 4, 5], [6, 7]]
    with pytest.raises(ValueError, match="2 samples cannot be split across dataParallelSize 3"):
        layout.data_shard([0, 1], 0)


@pytest.mark.parametrize("tp, field, numbers", [
    (3, "num_attention_heads", "tensorParallelSize 3 does not divide the model's num_attention_heads 4"),
    (4, "num_key_value_heads", "tensorParallelSize 4 does not divide the model's num_key_value_heads 2"),
    (3, "vocab_size", "tensorParallelSize 3 does not divide the model's vocab_size 320"),
])
def test_model_dimensions_must_divide_by_tensor_parallel(tp, field, numbers):
    with pytest.raises(ValueError, match=numbers):
        check_layout(ParallelLayout(tensor=tp), "megatron", TINY)


def test_ffn_must_divide_by_tensor_parallel():
    arch = Architecture.from_hf_config(dict(CONFIG, intermediate_size=130))
    assert any("intermediate_size 130" in p for p in layout_problems(ParallelLayout(tensor=4), "megatron", arch))


def test_more_stages_than_layers_are_refused_and_pipeline_stages_run_on_gpus():
    problems = layout_problems(ParallelLayout(pipeline=3), "megatron", TINY)
    assert any("pipelineParallelSize 3 is more stages than the model's 2 layers" in p for p in problems)
    assert layout_problems(ParallelLayout(pipeline=2), "megatron", TINY) == []
    assert layout_problems(ParallelLayout(pipeline=2), "megatron", TINY, device="cuda", devices_available=2) == []
    (problem,) = layout_problems(ParallelLayout(pipeline=2), "megatron", TINY, device="cuda", devices_available=1)
    assert "only 1 GPUs are visible" in problem
    assert any("model parallelism needs backend megatron" in p
               for p in layout_problems(ParallelLayout(pipeline=2), "torch", TINY))


def test_model_parallelism_needs_megatron_and_data_parallel_does_not():
    with pytest.raises(ValueError, match="model parallelism needs backend megatron"):
        check_layout(ParallelLayout(tensor=2), "torch", TINY)
    check_layout(ParallelLayout(data=4), "torch", TINY)


def test_more_ranks_than_gpus_is_refused():
    with pytest.raises(ValueError, match="4 ranks .* but only 2 GPUs are visible"):
        check_layout(ParallelLayout(tensor=2, data=2), "megatron", TINY, device="cuda", devices_available=2)
    check_layout(ParallelLayout(tensor=2, data=2), "megatron", TINY, device="cpu", devices_available=2)


def test_layout_sizes_must_be_positive():
    with pytest.raises(ValueError, match="dataParallelSize must be an integer >= 1"):
        ParallelLayout(data=0)


PLAN = ShardPlan(dims={"qkv": 0, "fc1": 0, "proj": 1, "norm": None}, gated=frozenset({"fc1"}))


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"qkv": torch.randn(8, 4, generator=g), "fc1": torch.randn(12, 4, generator=g),
            "proj": torch.randn(4, 6, generator=g), "norm": torch.randn(4, generator=g)}


@pytest.mark.parametrize("size", [1, 2])
def test_split_then_join_is_exact(size):
    full = full_state()
    parts = [split_for_rank(full, PLAN, r, size) for r in range(size)]
    for name in full:
        assert torch.equal(join_shards(name, [p[name] for p in parts], PLAN), full[name])


def test_gated_fc1_shard_holds_its_gate_rows_then_its_up_rows():
    full = full_state()
    gate, up = full["fc1"].chunk(2)
    part = split_for_rank(full, PLAN, 1, 2)["fc1"]
    assert torch.equal(part, torch.cat([gate[3:], up[3:]]))
    assert torch.equal(split_for_rank(full, PLAN, 0, 2)["proj"], full["proj"][:, :3])
    assert split_for_rank(full, PLAN, 1, 2)["norm"] is full["norm"]


def test_a_dimension_that_does_not_split_is_named():
    with pytest.raises(ValueError, match="qkv: dimension 0 of size 8 does not split into 3 shards"):
        split_for_rank(full_state(), PLAN, 0, 3)


def test_the_rank_to_blame_is_another_rank_before_rank_0():
    from types import SimpleNamespace

    from rlfleet.trainer.launch import culprit

    def failed(at: int) -> SimpleNamespace:
        return SimpleNamespace(timestamp=at)

    assert culprit({0: failed(5)})[0] == 0  # the run itself failed
    assert culprit({0: failed(4), 1: failed(5)})[0] == 1  # rank 0 lost a peer in a collective
    assert culprit({2: failed(6), 3: failed(5), 0: failed(1)})[0] == 3
