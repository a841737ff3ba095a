"""Weight layout conversion between Hugging Face Llama/Qwen2/Qwen3 and megatron-core GPTModel (local spec).

Pure functions over state dicts (name -> tensor); no I/O. Megatron fuses q/k/v into one
`linear_qkv` laid out per query group ([q heads of the group, k, v] for each of the
`num_query_groups` groups) and gate/up into `linear_fc1` ([gate; up]); Hugging Face keeps them
apart. Norms are separate modules in the local spec (`input_layernorm`, `pre_mlp_layernorm`), and
Qwen3's per-head RMSNorm of queries and keys (`q_norm`, `k_norm`) is megatron's `q_layernorm` /
`k_layernorm` (qk_layernorm), applied to each head before the rotary embedding in both.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class Architecture:
    """What the layout conversion needs to know about a Llama-family model."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of every query and key head
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> Architecture:
        """Read a config.json dict; reject what the megatron local spec cannot express."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported: expected one of {SUPPORTED_MODEL_TYPES}"
            )
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported: the megatron model uses SwiGLU (silu)")
        if model_type in ("llama", "qwen3") and (config.get("attention_bias") or config.get("mlp_bias")):
            raise ValueError(f"{model_type} with attention_bias or mlp_bias is not supported")
        if config.get("use_sliding_window") and config.get("sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window) is not supported")
        # transformers 5 keeps rope settings in rope_parameters; 4.x in rope_theta / rope_scaling.
        rope = dict(config.get("rope_scaling") or {})
        rope.update(config.get("rope_parameters") or {})
        rope_type = rope.get("rope_type") or rope.get("type")
        if rope_type not in (None, "default"):
            raise ValueError(f"rope scaling {rope_type!r} is not supported")
        rope_theta = float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0)
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        hidden = int(config["hidden_size"])
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        head_dim = int(config.get("head_dim") or hidden // heads)
        return cls(
            model_type=model_type,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            ffn_hidden_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
            rope_theta=rope_theta,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        )


def _hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def _mg_layer(i: int) -> str:
    return f"decoder.layers.{i}."


# (megatron suffix, HF suffix) of the per-layer tensors that map one to one.
_LAYER_RENAMES = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
)
# Qwen3's per-head query/key norms (qk_norm architectures only).
_QK_NORM_RENAMES = (
    ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
    ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
)
_GLOBAL_RENAMES = (
    ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    ("decoder.final_layernorm.weight", "model.norm.weight"),
)


def _layer_renames(arch: Architecture) -> tuple[tuple[str, str], ...]:
    return _LAYER_RENAMES + (_QK_NORM_RENAMES if arch.qk_norm else ())


def fuse_qkv(q: Any, k: Any, v: Any, arch: Architecture) -> Any:
    """[q; k; v] rows (HF) -> megatron's per-group interleaving. Works for weights and biases."""
    import torch

    rest = q.shape[1:]
    g, hd, per = arch.num_kv_heads, arch.head_dim, arch.heads_per_group
    q = q.reshape(g, per * hd, *rest)
    k = k.reshape(g, hd, *rest)
    v = v.reshape(g, hd, *rest)
    return torch.cat([q, k, v], dim=1).reshape(g * (per + 2) * hd, *rest)


def split_qkv(qkv: Any, arch: Architecture) -> tuple[Any, Any, Any]:
    """Inverse of fuse_qkv."""
    rest = qkv.shape[1:]
    g, hd, per = arch.num_kv_heads, arch.head_dim, arch.heads_per_group
    grouped = qkv.reshape(g, (per + 2) * hd, *rest)
    q = grouped[:, : per * hd].reshape(g * per * hd, *rest)
    k = grouped[:, per * hd : (per + 1) * hd].reshape(g * hd, *rest)
    v = grouped[:, (per + 1) * hd :].reshape(g * hd, *rest)
    return q, k, v


def hf_to_megatron(hf: Mapping[str, Any], arch: Architecture) -> dict[str, Any]:
    """HF Llama/Qwen2/Qwen3 state dict -> megatron GPTModel (local spec) state dict."""
    import torch

    _expect_keys(hf, expected_hf_keys(arch), "HF")
    out: dict[str, Any] = {}
    for mg, name in _GLOBAL_RENAMES:
        out[mg] = hf[name]
    if not arch.tied_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(arch.num_layers):
        h, m = _hf_layer(i), _mg_layer(i)
        for mg_suffix, hf_suffix in _layer_renames(arch):
            out[m + mg_suffix] = hf[h + hf_suffix]
        attn = h + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
            hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], arch
        )
        if arch.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = fuse_qkv(
                hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"], arch
            )
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]], dim=0
        )
    return out


def megatron_to_hf(mg: Mapping[str, Any], arch: Architecture) -> dict[str, Any]:
    """Megatron GPTModel (local spec) state dict -> HF Llama/Qwen2/Qwen3 names.

    `_extra_state` entries (serialisation state of some megatron modules) are ignored. With tied
    embeddings there is no `lm_head.weight`: HF re-ties it on load.
    """
    weights = {k: v for k, v in mg.items() if not k.endswith("_extra_state")}
    _expect_keys(weights, expected_megatron_keys(arch), "megatron")
    out: dict[str, Any] = {}
    for mg_name, hf_name in _GLOBAL_RENAMES:
        out[hf_name] = weights[mg_name]
    if not arch.tied_embeddings:
        out["lm_head.weight"] = weights["output_layer.weight"]
    for i in range(arch.num_layers):
        h, m = _hf_layer(i), _mg_layer(i)
        for mg_suffix, hf_suffix in _layer_renames(arch):
            out[h + hf_suffix] = weights[m + mg_suffix]
        attn = h + "self_attn."
        q, k, v = split_qkv(weights[m + "self_attention.linear_qkv.weight"], arch)
        out[attn + "q_proj.weight"], out[attn + "k_proj.weight"], out[attn + "v_proj.weight"] = q, k, v
        if arch.qkv_bias:
            qb, kb, vb = split_qkv(weights[m + "self_attention.linear_qkv.bias"], arch)
            out[attn + "q_proj.bias"], out[attn + "k_proj.bias"], out[attn + "v_proj.bias"] = qb, kb, vb
        gate, up = weights[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
    return out


def expected_hf_keys(arch: Architecture) -> set[str]:
    keys = {hf for _, hf in _GLOBAL_RENAMES}
    if not arch.tied_embeddings:
        keys.add("lm_head.weight")
    for i in range(arch.num_layers):
        h = _hf_layer(i)
        keys.update(h + hf for _, hf in _layer_renames(arch))
        keys.update(h + f"self_attn.{p}_proj.weight" for p in "qkv")
        if arch.qkv_bias:
            keys.update(h + f"self_attn.{p}_proj.bias" for p in "qkv")
        keys.update({h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"})
    return keys


def expected_megatron_keys(arch: Architecture) -> set[str]:
    keys = {mg for mg, _ in _GLOBAL_RENAMES}
    if not arch.tied_embeddings:
        keys.add("output_layer.weight")
    for i in range(arch.num_layers):
        m = _mg_layer(i)
        keys.update(m + mg for mg, _ in _layer_renames(arch))
        keys.update({m + "self_attention.linear_qkv.weight", m + "mlp.linear_fc1.weight"})
        if arch.qkv_bias:
            keys.add(m + "self_attention.linear_qkv.bias")
    return keys


def hf_state_for_save(hf: Mapping[str, Any], tied_embeddings: bool) -> dict[str, Any]:
    """The tensors to write to safetensors: no tied duplicate, no non-persistent buffers."""
    out = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
    if tied_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _expect_keys(state: Mapping[str, Any], expected: set[str], what: str) -> None:
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected - {"lm_head.weight"})
    if missing or unexpected:
        raise ValueError(
            f"{what} state dict does not match the architecture: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
