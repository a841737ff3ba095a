"""The collectives a multi-rank training step needs, over torch.distributed groups (gloo or NCCL).

- `start_reduce_stats`: a step's statistics, some summed and some maximised, in one asynchronous collective;
- `sum_gradients`: every replica's gradients summed, coalesced into one flat buffer per dtype (the loss
  is normalised by the whole step's tokens, so the sum is the gradient of the whole batch);
- `clip_grad_norm`: torch's clip_grad_norm_ with the norm taken over every shard of the model
  (tensor-parallel shards and pipeline stages), each replicated tensor counted once.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

# Waits for a started reduction of a step's statistics; returns (sums, maxima).
StatsReduction = Callable[[], tuple[list[float], list[float]]]


def start_reduce_stats(sums: list[float], maxima: list[float], group: Any) -> StatsReduction:
    """Start summing `sums` and maximising `maxima` over `group` in one all-gather (a step's statistics,
    one collective instead of one per operation, asynchronous so it travels beside the backward pass);
    every rank reduces the gathered rows in the same order when the returned waiter is called."""
    import torch
    import torch.distributed as dist

    if not sums and not maxima:
        return lambda: (sums, maxima)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    mine = torch.tensor([*sums, *maxima], dtype=torch.float64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(rows, mine, group=group, async_op=True)

    def wait() -> tuple[list[float], list[float]]:
        work.wait()
        table = torch.stack(rows).cpu()
        return ([float(v) for v in table[:, :len(sums)].sum(dim=0).tolist()],
                [float(v) for v in table[:, len(sums):].amax(dim=0).tolist()])

    return wait


def sum_gradients(params: Iterable[Any], group: Any) -> None:
    """All-reduce (sum) the gradients of `params` in `group`, one flat buffer per dtype and device."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    buckets: dict[tuple[Any, Any], list[Any]] = {}
    for p in params:
        if p.grad is not None:
            buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in buckets.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(reduced)


def clip_grad_norm(params: list[Any], max_norm: float, group: Any | None,
                   counts: Callable[[Any], bool] = lambda p: True) -> float:
    """Scale the gradients so their global 2-norm is at most max_norm; return the norm before.

    The squared norm is summed over the parameters `counts` admits (on this rank) and then over
    `group` (the model-parallel ranks holding the other shards); the scaling is torch's
    (`max_norm / (norm + 1e-6)`, capped at 1), so one rank and many give the same update.
    """
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    device = grads[0].device
    square = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if p.grad is not None and counts(p):
            square += p.grad.detach().float().pow(2).sum()
    if group is not None:
        dist.all_reduce(square, group=group)
    norm = square.sqrt()
    if max_norm and max_norm != float("inf"):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.detach().mul_(coef.to(g.dtype))
    return float(norm)
