"""Pipeline parallelism for the megatron backend: stages, their weights, and the forward/backward hand-off.

A pipeline of S stages splits the model's L layers into S equal runs of L/S (stage 0 also holds the
embedding, the last stage the final norm and the output layer; with tied embeddings the last stage
keeps a copy of the embedding as its output weight, whose gradient is summed with the first stage's).

Names: megatron numbers a stage's layers from 0 (`decoder.layers.<local>`); the HF round trip uses the
global numbers. `stage_part` takes a stage's part of the whole model under its local names,
`global_names` renames a stage's weights back; both pure.

Execution (one micro-batch, every stage of a pipeline group runs the same calls in the same order):
stage s > 0 receives its input activations from s-1 (`receive_input`, a leaf whose gradient is sent
back to s-1 in the backward pass); a stage before the last sends its output on and gets the logits
back (`hand_on`), the last broadcasts its logits to the group (`share_logits`). So every stage holds
the same logits and computes the same loss, and `loss.backward()` on every stage drives the whole
pipeline's backward pass: the last stage's gradient flows from its loss down to its input and on to the
stage before, whose `hand_on` receives it. Point-to-point and broadcast go over torch.distributed
(gloo on CPU).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from rlfleet.trainer.parallel import ParallelLayout

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM_PREFIX = "decoder.final_layernorm."


def layers_per_stage(num_layers: int, layout: ParallelLayout) -> int:
    return num_layers // layout.pipeline


def stage_part(full: Mapping[str, Any], stage: int, stages: int, num_layers: int, tied: bool) -> dict[str, Any]:
    """Stage `stage`'s weights of the whole model `full` (megatron names, global layer numbers), under
    the stage's own (local) names."""
    per = num_layers // stages
    first, last = stage == 0, stage == stages - 1
    out: dict[str, Any] = {}
    for name, value in full.items():
        match = _LAYER.match(name)
        if match:
            layer = int(match.group(1))
            if stage * per <= layer < (stage + 1) * per:
                out[f"decoder.layers.{layer - stage * per}.{match.group(2)}"] = value
        elif name == EMBEDDING:
            if first:
                out[name] = value
            if last and tied and stages > 1:
                out[OUTPUT] = value  # the last stage's copy of the tied embedding
        elif name.startswith(FINAL_NORM_PREFIX) or name == OUTPUT:
            if last:
                out[name] = value
        elif first:
            out[name] = value  # anything else (extra state) lives with the embedding
    return out


def global_names(part: Mapping[str, Any], stage: int, stages: int, num_layers: int, tied: bool) -> dict[str, Any]:
    """A stage's weights (local names) under the whole model's names; a tied copy is left out."""
    per = num_layers // stages
    out: dict[str, Any] = {}
    for name, value in part.items():
        match = _LAYER.match(name)
        if match:
            out[f"decoder.layers.{int(match.group(1)) + stage * per}.{match.group(2)}"] = value
        elif name == OUTPUT and tied and stages > 1:
            continue
        else:
            out[name] = value
    return out


# --- the hand-off between stages (torch.distributed; every stage calls these in the same order) -----


class Pipeline:
    """This rank's place in its pipeline group (megatron's parallel state) and the hand-off calls."""

    def __init__(self) -> None:
        from megatron.core import parallel_state as ps

        self.stage = ps.get_pipeline_model_parallel_rank()
        self.stages = ps.get_pipeline_model_parallel_world_size()
        self.first = ps.is_pipeline_first_stage()
        self.last = ps.is_pipeline_last_stage()
        self.group = ps.get_pipeline_model_parallel_group()
        self.prev_rank = ps.get_pipeline_model_parallel_prev_rank()
        self.next_rank = ps.get_pipeline_model_parallel_next_rank()
        self.last_rank = ps.get_pipeline_model_parallel_last_rank()
        self.embedding_group = ps.get_embedding_group() if self.first or self.last else None

    def receive_input(self, shape: tuple[int, ...], dtype: Any, device: Any) -> Any:
        """The previous stage's output activations; a leaf that sends its gradient back when the
        backward pass reaches it (when grad is enabled)."""
        import torch
        import torch.distributed as dist

        buffer = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buffer, src=self.prev_rank)
        if not torch.is_grad_enabled():
            return buffer
        return _GradToPrev.apply(buffer.requires_grad_(), self.prev_rank)

    def hand_on(self, output: Any, logits_shape: tuple[int, ...], dtype: Any) -> Any:
        """Send this stage's output to the next stage; the pipeline's logits (the last stage's)."""
        return _ToNext.apply(output, self, logits_shape, dtype)

    def share_logits(self, logits: Any) -> Any:
        """The last stage's logits, broadcast to every stage of the group."""
        return _ShareLogits.apply(logits, self)

    def sum_tied_gradient(self, weight: Any) -> None:
        """The first stage's embedding and the last stage's output copy take the sum of both gradients."""
        import torch
        import torch.distributed as dist

        if self.embedding_group is None or self.stages == 1:
            return
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=self.embedding_group)

    def gather_states(self, part: dict[str, Any]) -> dict[str, Any]:
        """Every stage's weights (whole-model names), merged, on every stage of the group."""
        import torch.distributed as dist

        parts: list[Any] = [None] * self.stages
        dist.all_gather_object(parts, part, group=self.group)
        merged: dict[str, Any] = {}
        for p in parts:
            merged.update(p)
        return merged


def _torch_function() -> Any:
    import torch

    return torch.autograd.Function


class _GradToPrev(_torch_function()):  # type: ignore[misc]  # torch's Function, imported lazily
    @staticmethod
    def forward(ctx: Any, received: Any, prev_rank: int) -> Any:
        ctx.prev_rank = prev_rank
        return received.view_as(received)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        import torch.distributed as dist

        dist.send(grad.contiguous(), dst=ctx.prev_rank)
        return grad, None


class _ToNext(_torch_function()):  # type: ignore[misc]
    @staticmethod
    def forward(ctx: Any, output: Any, pipe: Pipeline, logits_shape: tuple[int, ...], dtype: Any) -> Any:
        import torch
        import torch.distributed as dist

        ctx.pipe, ctx.shape, ctx.dtype = pipe, output.shape, output.dtype
        dist.send(output.detach().contiguous(), dst=pipe.next_rank)
        logits = torch.empty(logits_shape, dtype=dtype, device=output.device)
        dist.broadcast(logits, src=pipe.last_rank, group=pipe.group)
        return logits

    @staticmethod
    def backward(ctx: Any, _grad_logits: Any) -> Any:
        import torch
        import torch.distributed as dist

        grad = torch.empty(ctx.shape, dtype=ctx.dtype, device=_grad_logits.device)
        dist.recv(grad, src=ctx.pipe.next_rank)
        return grad, None, None, None


class _ShareLogits(_torch_function()):  # type: ignore[misc]
    @staticmethod
    def forward(ctx: Any, logits: Any, pipe: Pipeline) -> Any:
        import torch.distributed as dist

        shared = logits.detach().contiguous().clone()
        dist.broadcast(shared, src=pipe.last_rank, group=pipe.group)
        return shared

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return grad, None
