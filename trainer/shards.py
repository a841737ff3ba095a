"""Tensor-parallel shards of megatron-core weights: split a full state dict per rank, join the shards.

Pure functions over tensors; the caller does the communication (an all-gather in the tensor-parallel
group). Which dimension a parameter is split on comes from megatron itself (the `tensor_model_parallel`
and `partition_dim` attributes its parallel layers set), read once into a `ShardPlan`:

- column-parallel weights (linear_qkv, linear_fc1, output_layer) and the vocab-parallel embedding are
  split on dim 0; linear_qkv is laid out per query group, so rank r holds whole groups;
- linear_fc1 of a gated MLP holds [gate; up]: each rank holds [its gate rows; its up rows];
- row-parallel weights (linear_proj, linear_fc2) are split on dim 1;
- everything else (norms, Qwen3's q/k norms) is whole on every rank.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ShardPlan:
    """name -> the dimension its tensor-parallel shards split (None: replicated); gated names."""

    dims: Mapping[str, int | None]
    gated: frozenset[str] = frozenset()

    @classmethod
    def of(cls, module: Any) -> ShardPlan:
        """The plan of a megatron module, from its parameters' attributes."""
        dims: dict[str, int | None] = {}
        gated = set()
        for name, param in module.named_parameters():
            parallel = bool(getattr(param, "tensor_model_parallel", False))
            dims[name] = int(param.partition_dim) if parallel else None
            if parallel and name.endswith("mlp.linear_fc1.weight") and module.config.gated_linear_unit:
                gated.add(name)
        return cls(dims, frozenset(gated))


def split_for_rank(full: Mapping[str, Any], plan: ShardPlan, rank: int, size: int) -> dict[str, Any]:
    """Tensor-parallel rank `rank`'s part of a full megatron state dict (names of the plan only)."""
    import torch

    out: dict[str, Any] = {}
    for name, dim in plan.dims.items():
        tensor = full[name]
        if dim is None or size == 1:
            out[name] = tensor
        elif name in plan.gated:
            gate, up = tensor.chunk(2, dim=dim)
            out[name] = torch.cat([_part(gate, dim, rank, size, name), _part(up, dim, rank, size, name)], dim=dim)
        else:
            out[name] = _part(tensor, dim, rank, size, name)
    return out


def join_shards(name: str, shards: Sequence[Any], plan: ShardPlan) -> Any:
    """The full tensor from every tensor-parallel rank's shard of `name`, in rank order."""
    import torch

    dim = plan.dims[name]
    if dim is None or len(shards) == 1:
        return shards[0]
    if name in plan.gated:
        halves = [s.chunk(2, dim=dim) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves], dim=dim), torch.cat([h[1] for h in halves], dim=dim)],
                         dim=dim)
    return torch.cat(list(shards), dim=dim)


def _part(tensor: Any, dim: int, rank: int, size: int, name: str) -> Any:
    if tensor.shape[dim] % size:
        raise ValueError(f"{name}: dimension {dim} of size {tensor.shape[dim]} does not split into {size} shards")
    return tensor.chunk(size, dim=dim)[rank].contiguous()
