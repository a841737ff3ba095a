"""Pure: how an engine holds the trainer's tensors (layouts, shards), and judging an engine's ranks by them.

That the shards equal what SGLang's own model code holds is checked against SGLang itself in
tests/integration/test_served_weights.py; here, the rules and the refusals."""
from __future__ import annotations

import torch

from rlfleet.orchestrator.fleet import broadcast_plan as plan
from rlfleet.orchestrator.fleet.served_weights import EngineLayout, served_tensors
from rlfleet.sglang.engine import RankChecksums

CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 8, "vocab_size": 6}


def tensors() -> dict[str, torch.Tensor]:
    prefix = "model.layers.0"
    return {
        "model.embed_tokens.weight": torch.arange(48.0).reshape(6, 8),
        f"{prefix}.self_attn.q_proj.weight": torch.arange(64.0).reshape(8, 8),  # 4 heads of 2
        f"{prefix}.self_attn.k_proj.weight": torch.arange(32.0).reshape(4, 8) + 100,  # 2 kv heads
        f"{prefix}.self_attn.v_proj.weight": torch.arange(32.0).reshape(4, 8) + 200,
        f"{prefix}.self_attn.o_proj.weight": torch.arange(64.0).reshape(8, 8) + 300,
        f"{prefix}.mlp.gate_proj.weight": torch.ones(4, 8),
        f"{prefix}.mlp.up_proj.weight": torch.zeros(4, 8),
        f"{prefix}.input_layernorm.weight": torch.ones(8),
    }


def test_a_cpu_engine_serves_the_tensors_as_exported():
    layout = EngineLayout.of(device="cpu", tp_size=1, config=CONFIG)
    assert isinstance(layout, EngineLayout) and not layout.native
    served = dict(served_tensors(tensors(), layout))
    assert served.keys() == tensors().keys()
    assert all(torch.equal(served[name], t) for name, t in tensors().items())


def test_sglang_model_code_fuses_qkv_and_gate_up_and_pads_the_vocabulary():
    layout = EngineLayout.of(device="cuda", tp_size=1, config=CONFIG)
    assert isinstance(layout, EngineLayout) and layout.native
    served = dict(served_tensors(tensors(), layout))
    t = tensors()
    assert "model.layers.0.self_attn.q_proj.weight" not in served
    assert torch.equal(served["model.layers.0.self_attn.qkv_proj.weight"],
                       torch.cat([t[f"model.layers.0.self_attn.{m}_proj.weight"] for m in "qkv"]))
    assert torch.equal(served["model.layers.0.mlp.gate_up_proj.weight"],
                       torch.cat([torch.ones(4, 8), torch.zeros(4, 8)]))
    embed = served["model.embed_tokens.weight"]
    assert embed.shape == (64, 8) and torch.equal(embed[:6], t["model.embed_tokens.weight"]) and not embed[6:].any()


def test_two_ranks_hold_rows_of_column_parallel_columns_of_row_parallel_and_whole_norms():
    layout = EngineLayout.of(device="cuda", tp_size=2, config=CONFIG)
    assert isinstance(layout, EngineLayout)
    t = tensors()
    ranks = [dict(served_tensors(t, layout, rank)) for rank in (0, 1)]
    q, k, v = (t[f"model.layers.0.self_attn.{m}_proj.weight"] for m in "qkv")
    for rank, served in enumerate(ranks):
        assert torch.equal(served["model.layers.0.self_attn.qkv_proj.weight"],
                           torch.cat([q[rank * 4:rank * 4 + 4], k[rank * 2:rank * 2 + 2], v[rank * 2:rank * 2 + 2]]))
        assert torch.equal(served["model.layers.0.self_attn.o_proj.weight"],
                           t["model.layers.0.self_attn.o_proj.weight"][:, rank * 4:rank * 4 + 4])
        assert torch.equal(served["model.layers.0.input_layernorm.weight"], torch.ones(8))
        assert served["model.embed_tokens.weight"].shape == (32, 8)  # 6 rows padded to 64, 32 a rank
    assert not ranks[1]["model.embed_tokens.weight"].any()  # rank 1's part lies past the 6 rows: all padding


def test_fewer_kv_heads_than_ranks_each_kv_head_is_held_by_several():
    layout = EngineLayout.of(device="cuda", tp_size=4, config={**CONFIG, "num_key_value_heads": 2})
    assert isinstance(layout, EngineLayout) and layout.head_dim == 2
    k = tensors()["model.layers.0.self_attn.k_proj.weight"]
    # Each rank: 1 of the 4 q heads (2 rows), then its kv head's k rows (2), then its v rows (2).
    held = [dict(served_tensors(tensors(), layout, rank))["model.layers.0.self_attn.qkv_proj.weight"][2:4]
            for rank in range(4)]
    assert [torch.equal(h, k[0:2]) for h in held] == [True, True, False, False]
    assert torch.equal(held[2], k[2:4]) and torch.equal(held[3], k[2:4])


def test_layouts_that_cannot_be_predicted_say_why():
    assert "Transformers implementation" in str(EngineLayout.of(device="cpu", tp_size=2, config=CONFIG))
    assert "lacks" in str(EngineLayout.of(device="cuda", tp_size=2, config={"vocab_size": 6}))
    assert "not split evenly" in str(EngineLayout.of(device="cuda", tp_size=3, config=CONFIG))


def test_an_engine_is_judged_over_all_its_ranks_naming_the_rank_that_differs():
    expected = [{"a": "1", "b": "2"}, {"a": "3", "b": "4"}]
    same = plan.compare_engine(expected, [RankChecksums({"a": "1", "b": "2"}, 0, 2),
                                          RankChecksums({"model.a": "3", "b": "4"}, 1, 2)])
    assert isinstance(same, plan.ChecksumVerdict) and same.ok and same.compared == 4
    differs = plan.compare_engine(expected, [RankChecksums({"a": "1", "b": "2"}, 0, 2),
                                             RankChecksums({"a": "3", "b": "x"}, 1, 2)])
    assert isinstance(differs, plan.ChecksumVerdict) and differs.mismatched == ("b (tp rank 1)",)
    one_rank = plan.compare_engine([{"a": "1"}], [RankChecksums({"a": "2"})])
    assert isinstance(one_rank, plan.ChecksumVerdict) and one_rank.mismatched == ("a",)


def test_ranks_of_an_unknown_place_or_another_layout_are_not_judged():
    expected = [{"a": "1"}, {"a": "2"}]
    assert "tensor-parallel rank None" in str(plan.compare_engine(expected, [RankChecksums({"a": "1"}, None, 2)]))
    assert "expected 2" in str(plan.compare_engine(expected, [RankChecksums({"a": "1"}, 0, 4)]))
    assert "attention data parallel" in str(plan.compare_engine(expected, [RankChecksums({"a": "1"}, 0, 2, dp_size=2)]))
    assert "matches" in str(plan.compare_engine(expected, [RankChecksums({"z": "1"}, 0, 2)]))
    assert "no rank" in str(plan.compare_engine(expected, []))


def test_a_weights_checker_answer_gives_each_rank_its_place():
    info = {"role": "target", "tp_rank": 1, "tp_size": 2, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
            "rank": 1, "size": 2}
    rank = RankChecksums.from_reply({"checksums": {"a": 1}, "parallelism_info": info}, 2)
    assert rank == RankChecksums({"a": "1"}, tp_rank=1, tp_size=2)
    assert RankChecksums.from_reply({"checksums": {}}, 1).tp_rank == 0  # an older answer of one rank
    assert RankChecksums.from_reply({"checksums": {}}, 2).tp_rank is None  # ... of several: place unknown


def test_a_tied_lm_head_is_the_embeddings_under_another_name_hashed_once():
    native = EngineLayout.of(device="cuda", tp_size=1, config=CONFIG)
    assert isinstance(native, EngineLayout)
    sums = plan.checksums(tensors(), layout=native)
    assert sums["lm_head.weight"] == sums["model.embed_tokens.weight"]
    untied = {**tensors(), "lm_head.weight": torch.ones(6, 8)}
    assert plan.checksums(untied, layout=native)["lm_head.weight"] != sums["model.embed_tokens.weight"]
    assert "lm_head.weight" not in plan.checksums(tensors())  # a CPU engine: the tensors as exported
