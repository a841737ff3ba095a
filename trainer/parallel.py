"""The trainer's parallel layout: tensor x pipeline x data parallel ranks, and what it can run.

Pure: no torch.distributed, no I/O. Every check raises ValueError naming the spec field and the
numbers, before any rank or engine starts (the launcher, the run loop and the backends all call
`check_layout`).

    layout = ParallelLayout(tensor=2, pipeline=1, data=2)          # world 4
    check_layout(layout, "megatron", arch, device="cpu")            # heads, kv heads, vocab, ffn, layers
    shard = layout.data_shard(batch, data_rank=1)                   # that replica's part of the batch
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from rlfleet.trainer.hf_export import Architecture

T = TypeVar("T")

# Ranks are numbered as megatron-core numbers them by default (order "tp-cp-ep-dp-pp"): tensor
# parallel fastest, then data parallel, then pipeline stage.


@dataclass(frozen=True)
class ParallelLayout:
    tensor: int = 1
    pipeline: int = 1
    data: int = 1

    def __post_init__(self) -> None:
        for name, value in (("tensorParallelSize", self.tensor), ("pipelineParallelSize", self.pipeline),
                            ("dataParallelSize", self.data)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"spec.trainer.{name} must be an integer >= 1, got {value!r}")

    @property
    def world(self) -> int:
        return self.tensor * self.pipeline * self.data

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tensor rank, data rank, pipeline stage) of a global rank."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a world of {self.world}")
        return rank % self.tensor, (rank // self.tensor) % self.data, rank // (self.tensor * self.data)

    def data_shard(self, batch: Sequence[T], data_rank: int) -> list[T]:
        """Data-parallel replica `data_rank`'s contiguous part of `batch` (sizes differ by at most 1)."""
        if len(batch) < self.data:
            raise ValueError(
                f"a batch of {len(batch)} samples cannot be split across dataParallelSize {self.data} replicas"
            )
        base, extra = divmod(len(batch), self.data)
        start = data_rank * base + min(data_rank, extra)
        return list(batch[start : start + base + (1 if data_rank < extra else 0)])


def check_layout(layout: ParallelLayout, backend: str, arch: Architecture | None = None,
                 device: str = "cpu", devices_available: int | None = None, local_ranks: int | None = None) -> None:
    """Raise ValueError naming the field and the numbers when `layout` cannot run `arch` on `backend`.

    `local_ranks`: the ranks on this machine (a node of a trainer group); default the whole world."""
    problems = layout_problems(layout, backend, arch, device, devices_available, local_ranks)
    if problems:
        raise ValueError("; ".join(problems))


def layout_problems(layout: ParallelLayout, backend: str, arch: Architecture | None = None,
                    device: str = "cpu", devices_available: int | None = None,
                    local_ranks: int | None = None) -> list[str]:
    problems: list[str] = []
    if backend != "megatron" and (layout.tensor > 1 or layout.pipeline > 1):
        problems.append(f"spec.trainer.tensorParallelSize {layout.tensor} x pipelineParallelSize "
                        f"{layout.pipeline}: model parallelism needs backend megatron (backend is {backend})")
    here = layout.world if local_ranks is None else local_ranks
    if device.startswith("cuda") and devices_available is not None and here > devices_available:
        where = "" if here == layout.world else f", {here} on this node (spec.trainer.gpus)"
        problems.append(f"the trainer is {layout.world} ranks (tensorParallelSize {layout.tensor} x "
                        f"pipelineParallelSize {layout.pipeline} x dataParallelSize {layout.data}{where}) but only "
                        f"{devices_available} GPUs are visible: one rank per GPU")
    if arch is None:
        return problems
    tp = layout.tensor
    for what, value in (("num_attention_heads", arch.num_heads), ("num_key_value_heads", arch.num_kv_heads),
                        ("vocab_size", arch.vocab_size), ("intermediate_size", arch.ffn_hidden_size)):
        if value % tp:
            problems.append(f"spec.trainer.tensorParallelSize {tp} does not divide the model's {what} {value}")
    pp = layout.pipeline
    if pp > arch.num_layers:
        problems.append(f"spec.trainer.pipelineParallelSize {pp} is more stages than the model's "
                        f"{arch.num_layers} layers (num_hidden_layers)")
    elif arch.num_layers % pp:
        problems.append(f"spec.trainer.pipelineParallelSize {pp} does not divide the model's "
                        f"{arch.num_layers} layers (num_hidden_layers) into equal stages")
    return problems
