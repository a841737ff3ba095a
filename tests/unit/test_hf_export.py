"""HF <-> megatron weight layout: fused q/k/v per query group, fused gate/up, exact round trips."""
from __future__ import annotations

import pytest
import torch

from rlfleet.trainer.hf_export import (
    Architecture,
    expected_hf_keys,
    fuse_qkv,
    hf_state_for_save,
    hf_to_megatron,
    megatron_to_hf,
    split_qkv,
)

LLAMA = {
    "model_type": "llama", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 40, "tie_word_embeddings": True,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
}
QWEN2 = dict(LLAMA, model_type="qwen2", tie_word_embeddings=False, num_key_value_heads=1, rope_theta=1e6)
QWEN2.pop("rope_parameters")
# Qwen3: per-head q/k norms, no biases, head_dim (8) other than hidden_size / heads (4).
QWEN3 = dict(LLAMA, model_type="qwen3", head_dim=8, tie_word_embeddings=False, attention_bias=False)


def random_hf_state(arch: Architecture, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hd, h = arch.head_dim, arch.hidden_size
    shapes = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)}
    if not arch.tied_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (arch.num_heads * hd, h),
            p + "self_attn.k_proj.weight": (arch.num_kv_heads * hd, h),
            p + "self_attn.v_proj.weight": (arch.num_kv_heads * hd, h),
            p + "self_attn.o_proj.weight": (h, arch.num_heads * hd),
            p + "mlp.gate_proj.weight": (arch.ffn_hidden_size, h),
            p + "mlp.up_proj.weight": (arch.ffn_hidden_size, h),
            p + "mlp.down_proj.weight": (h, arch.ffn_hidden_size),
        })
        if arch.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        if arch.qkv_bias:
            shapes.update({
                p + "self_attn.q_proj.bias": (arch.num_heads * hd,),
                p + "self_attn.k_proj.bias": (arch.num_kv_heads * hd,),
                p + "self_attn.v_proj.bias": (arch.num_kv_heads * hd,),
            })
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


@pytest.mark.parametrize("config", [LLAMA, QWEN2, QWEN3],
                         ids=["llama-gqa-tied", "qwen2-mqa-bias-untied", "qwen3-qk-norm-head-dim"])
def test_hf_to_megatron_to_hf_is_exact(config):
    arch = Architecture.from_hf_config(config)
    hf = random_hf_state(arch)
    back = megatron_to_hf(hf_to_megatron(hf, arch), arch)
    assert set(back) == set(hf) == expected_hf_keys(arch)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_fused_qkv_is_interleaved_per_query_group():
    # 4 query heads, 2 groups, head_dim 1: [q0 q1 k0 v0 | q2 q3 k1 v1].
    arch = Architecture.from_hf_config(dict(LLAMA, hidden_size=4, head_dim=1))
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    fused = fuse_qkv(q, k, v, arch)
    assert fused.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    q2, k2, v2 = split_qkv(fused, arch)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_fused_fc1_is_gate_then_up():
    arch = Architecture.from_hf_config(LLAMA)
    hf = random_hf_state(arch)
    mg = hf_to_megatron(hf, arch)
    fc1 = mg["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[: arch.ffn_hidden_size], hf["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(fc1[arch.ffn_hidden_size:], hf["model.layers.1.mlp.up_proj.weight"])


def test_megatron_extra_state_is_ignored_and_tied_head_dropped():
    arch = Architecture.from_hf_config(LLAMA)
    mg = hf_to_megatron(random_hf_state(arch), arch)
    mg["decoder.layers.0.self_attention.core_attention._extra_state"] = None
    hf = megatron_to_hf(mg, arch)
    assert "lm_head.weight" not in hf
    assert not any("_extra_state" in k for k in hf)


def test_mismatched_state_dict_is_refused_with_names():
    arch = Architecture.from_hf_config(LLAMA)
    hf = random_hf_state(arch)
    del hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="missing.*up_proj"):
        hf_to_megatron(hf, arch)


def test_tied_lm_head_is_not_saved():
    state = {"model.embed_tokens.weight": 1, "lm_head.weight": 1, "model.rotary_emb.inv_freq": 2}
    assert hf_state_for_save(state, tied_embeddings=True) == {"model.embed_tokens.weight": 1}
    assert set(hf_state_for_save(state, tied_embeddings=False)) == {"model.embed_tokens.weight", "lm_head.weight"}


def test_architecture_reads_both_rope_conventions():
    assert Architecture.from_hf_config(LLAMA).rope_theta == 500000.0
    assert Architecture.from_hf_config(QWEN2).rope_theta == 1e6
    assert Architecture.from_hf_config(QWEN2).qkv_bias
    assert Architecture.from_hf_config(LLAMA).head_dim == 4


def test_qwen3_qk_norms_map_to_megatron_qk_layernorm():
    arch = Architecture.from_hf_config(QWEN3)
    assert arch.qk_norm and not arch.qkv_bias and arch.head_dim == 8
    hf = random_hf_state(arch)
    mg = hf_to_megatron(hf, arch)
    assert torch.equal(mg["decoder.layers.1.self_attention.q_layernorm.weight"],
                       hf["model.layers.1.self_attn.q_norm.weight"])
    assert torch.equal(mg["decoder.layers.0.self_attention.k_layernorm.weight"],
                       hf["model.layers.0.self_attn.k_norm.weight"])
    # heads x head_dim (32) rows of q, kv heads x head_dim of k and v, fused: (4 + 2 + 2) x 8.
    assert mg["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (64, 16)


def test_unsupported_family_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"'gpt2' is not supported: expected one of \('llama', 'qwen2', 'qwen3'\)"):
        Architecture.from_hf_config(dict(LLAMA, model_type="gpt2"))


@pytest.mark.parametrize("change, message", [
    ({"model_type": "mistral"}, "model_type"),
    ({"model_type": "qwen3", "attention_bias": True}, "qwen3 with attention_bias"),
    ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 16}, "sliding-window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}}, "llama3"),
    ({"num_key_value_heads": 3}, "multiple"),
])
def test_unsupported_architectures_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        Architecture.from_hf_config(dict(LLAMA, **change))
