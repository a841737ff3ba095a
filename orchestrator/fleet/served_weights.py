"""Where an SGLang engine keeps the trainer's tensors: the names and shards its `/weights_checker` hashes.

Pure: it lets the checksum verification of a weight sync predict every engine rank's checksums.

- CPU engines run SGLang's Transformers implementation (`--model-impl transformers`, one rank): the
  Hugging Face names and tensors as the trainer exports them.
- CUDA engines run SGLang's own model code for the families the trainer exports (llama, qwen2, qwen3):
  q, k and v are one `qkv_proj` (their rows in that order), gate and up one `gate_up_proj`, and
  `embed_tokens` / `lm_head` have their vocabulary padded with zero rows to a multiple of 64. With tensor
  parallel size T, rank r holds its share of each weight: the rows of column-parallel ones (q by heads;
  k and v by heads, one kv head held by T / kv_heads ranks when there are fewer kv heads than ranks;
  gate, up; the padded vocabulary), the columns of row-parallel ones (o_proj, down_proj), and the whole
  of the rest (norms). Pipeline stages keep the global layer names, so a stage's rank lists its layers;
  with tied embeddings the last stage of some model classes (qwen3) holds an `lm_head` of its own, loaded
  from the embeddings (`tied_aliases`).

Checked against SGLang's own model classes and weight loaders on one rank, two tensor-parallel ranks
and two pipeline stages (`tests/integration/test_served_weights.py`).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

FUSED = {  # SGLang's stacked parameters: Hugging Face module -> (served module, position)
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
FUSED_PARTS = {"qkv_proj": 3, "gate_up_proj": 2}
KV_MODULES = frozenset({"k_proj", "v_proj"})
COLUMN_PARALLEL = frozenset({"q_proj", "gate_proj", "up_proj"}) | KV_MODULES
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})
VOCAB_PARALLEL = frozenset({"embed_tokens", "lm_head"})
VOCAB_PADDING = 64  # SGLang's DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class EngineLayout:
    """How one engine holds the weights: SGLang's own model code or its Transformers implementation,
    over how many tensor-parallel ranks, for a model of these kv heads and vocabulary."""

    native: bool
    tp_size: int = 1
    kv_heads: int = 1
    head_dim: int = 1
    vocab_size: int = 0

    @classmethod
    def of(cls, *, device: str, tp_size: int, config: Mapping[str, Any],
           quantization: str | None = None) -> EngineLayout | str:
        """The layout of an engine on `device` with `tp_size` ranks serving a model of `config` (its
        config.json's shape keys), quantized as `quantization` (None: as loaded), or why its checksums
        cannot be predicted."""
        if quantization is not None:
            return (f"the engines serve the weights quantized ({quantization}): their checksums are of other "
                    "values than the trainer's")
        native = device != "cpu"
        if tp_size == 1:
            return cls(native=native, vocab_size=int(config.get("vocab_size") or 0))
        if not native:
            return f"a CPU engine of {tp_size} tensor-parallel ranks runs SGLang's Transformers implementation"
        try:
            heads = int(config["num_attention_heads"])
            kv_heads = int(config.get("num_key_value_heads") or heads)
            head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
            vocab_size = int(config["vocab_size"])
        except (KeyError, TypeError, ValueError) as exc:
            return f"the model's config.json lacks what tensor-parallel shards are cut by: {exc!r}"
        if heads % tp_size or (kv_heads % tp_size and tp_size % kv_heads):
            return f"{heads} heads and {kv_heads} kv heads are not split evenly over {tp_size} ranks"
        return cls(native=True, tp_size=tp_size, kv_heads=kv_heads, head_dim=head_dim,
                   vocab_size=vocab_size)


def _split_name(name: str) -> tuple[str, str, str]:
    """`model.layers.0.self_attn.q_proj.weight` -> (`model.layers.0.self_attn`, `q_proj`, `weight`)."""
    head, _, suffix = name.rpartition(".")
    prefix, _, module = head.rpartition(".")
    return prefix, module, suffix


def _join(prefix: str, module: str, suffix: str) -> str:
    return f"{prefix}.{module}.{suffix}" if prefix else f"{module}.{suffix}"


def _rows(tensor: Any, start: int, count: int) -> Any:
    return tensor.narrow(0, start, count)


def _shard(module: str, tensor: Any, layout: EngineLayout, rank: int) -> Any:
    """Rank `rank`'s part of one Hugging Face tensor of `module` (before any fusing)."""
    import torch

    t = layout.tp_size
    if module in VOCAB_PARALLEL and layout.native:
        padded = -(-max(layout.vocab_size, tensor.shape[0]) // VOCAB_PADDING) * VOCAB_PADDING
        per_rank = padded // t
        start = min(rank * per_rank, tensor.shape[0])
        part = _rows(tensor, start, min(per_rank, tensor.shape[0] - start))
        if part.shape[0] == per_rank:
            return part
        pad = torch.zeros((per_rank - part.shape[0], *part.shape[1:]), dtype=part.dtype, device=part.device)
        return torch.cat([part, pad])
    if t == 1:
        return tensor
    if module in KV_MODULES and layout.kv_heads < t:
        head = rank // (t // layout.kv_heads)  # fewer kv heads than ranks: each is held by several
        return _rows(tensor, head * layout.head_dim, layout.head_dim)
    if module in COLUMN_PARALLEL:
        per_rank = tensor.shape[0] // t
        return _rows(tensor, rank * per_rank, per_rank)
    if module in ROW_PARALLEL and tensor.dim() == 2:
        per_rank = tensor.shape[1] // t
        return tensor.narrow(1, rank * per_rank, per_rank)
    return tensor


def served_tensors(tensors: Mapping[str, Any], layout: EngineLayout, rank: int = 0) -> Iterator[tuple[str, Any]]:
    """What tensor-parallel rank `rank` of an engine of `layout` serves under each name, made from the
    trainer's Hugging Face `tensors`, one at a time (a large model is never copied whole). A fused
    parameter whose parts are not all there is left out (the engine's is then not compared)."""
    import torch

    fused: dict[tuple[str, str, str], list[Any]] = {}
    for name, tensor in tensors.items():
        prefix, module, suffix = _split_name(name)
        if layout.native and module in FUSED:
            target, position = FUSED[module]
            parts = fused.setdefault((prefix, target, suffix), [None] * FUSED_PARTS[target])
            parts[position] = (module, tensor)
            if all(p is not None for p in parts):
                del fused[(prefix, target, suffix)]
                yield _join(prefix, target, suffix), torch.cat([_shard(m, x, layout, rank) for m, x in parts])
            continue
        yield name, _shard(module, tensor, layout, rank)


def tied_aliases(names: Iterable[str], layout: EngineLayout) -> dict[str, str]:
    """Served names that hold the same as another (alias -> name): with tied embeddings (no `lm_head` among
    the trainer's tensors) SGLang's own model code may keep an `lm_head` loaded from `embed_tokens`."""
    names = set(names)
    if layout.native and "model.embed_tokens.weight" in names and "lm_head.weight" not in names:
        return {"lm_head.weight": "model.embed_tokens.weight"}
    return {}
