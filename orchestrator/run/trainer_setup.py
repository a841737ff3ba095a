"""The run's trainer from its spec: one rank, or rank 0 of a group the rank launcher started.

`trainer_kwargs(spec)` is the one mapping of `spec.trainer` onto the trainer's options, used by rank 0
(the run loop) and every other rank alike, so all ranks build the same model the same way.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rlfleet.crds.models import TrainingRunSpec
from rlfleet.trainer import grpo
from rlfleet.trainer.base import Trainer, build_trainer
from rlfleet.trainer.parallel import ParallelLayout
from rlfleet.trainer.ranks import LeadingTrainer, rank_env


def layout_of(spec: TrainingRunSpec) -> ParallelLayout:
    t = spec.trainer
    return ParallelLayout(tensor=t.tensor_parallel_size, pipeline=t.pipeline_parallel_size, data=t.data_parallel_size)


def device_of(spec: TrainingRunSpec) -> str:
    return "cpu" if spec.trainer.gpus == 0 else "cuda"


def trainer_kwargs(spec: TrainingRunSpec) -> dict[str, Any]:
    t = spec.trainer
    return dict(
        seed=t.seed, device=device_of(spec), max_grad_norm=t.grad_clip, micro_batch_size=t.micro_batch_size,
        loss=grpo.LossConfig(clip_low=t.eps_clip, clip_high=t.eps_clip, temperature=t.temperature or 1.0,
                             kl_coef=t.kl_coef),
        parallel=layout_of(spec), data_parallel_mode=t.data_parallel_mode,
    )


def build_rank_trainer(spec: TrainingRunSpec, model_dir: Path) -> Trainer:
    """This rank's trainer; with more than one rank, after joining the launcher's process group."""
    kwargs = trainer_kwargs(spec)
    layout = kwargs["parallel"]
    if layout.world > 1:
        from rlfleet.trainer.ranks import init_process_group

        if rank_env()[1] != layout.world:
            raise ValueError(
                f"spec.trainer asks for {layout.world} ranks (tensorParallelSize {layout.tensor} x "
                f"pipelineParallelSize {layout.pipeline} x dataParallelSize {layout.data}) but this process was "
                "not started as one of them: `rlfleet run FILE` (and a trainer pod's `rlfleet run --kubernetes`) "
                "starts the ranks itself"
            )
        kwargs["device"] = init_process_group(kwargs["device"])
    return build_trainer(spec.trainer.backend, model_dir, spec.trainer.learning_rate, **kwargs)


def build_run_trainer(spec: TrainingRunSpec, model_dir: Path) -> Trainer | LeadingTrainer:
    """The trainer the run loop drives: the plain trainer, or (world > 1) rank 0's LeadingTrainer."""
    trainer = build_rank_trainer(spec, model_dir)
    if layout_of(spec).world == 1:
        return trainer
    if rank_env()[0] != 0:
        raise RuntimeError("the run loop runs in rank 0 only")
    return LeadingTrainer(trainer)


def ranks_label(spec: TrainingRunSpec) -> str:
    """The progress line's trainer: "4 ranks tp2 pp1 dp2"; empty for a trainer of one rank."""
    layout = layout_of(spec)
    sharded = " fsdp" if spec.trainer.data_parallel_mode == "fsdp" else ""
    return "" if layout.world == 1 else (f"{layout.world} ranks tp{layout.tensor} pp{layout.pipeline} "
                                         f"dp{layout.data}{sharded}")


def describe(spec: TrainingRunSpec) -> str:
    layout = layout_of(spec)
    backend = "gloo" if device_of(spec) == "cpu" else "nccl"
    over = f", {backend}" if layout.world > 1 else ""
    sharded = ", replicas sharded (fsdp)" if spec.trainer.data_parallel_mode == "fsdp" else ""
    return (f"{spec.trainer.backend} trainer: {layout.world} rank(s) (tensor {layout.tensor} x pipeline "
            f"{layout.pipeline} x data {layout.data}{sharded}) on {device_of(spec)}{over}")
