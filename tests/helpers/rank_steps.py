"""Rank entry points for the multi-rank trainer tests: the same GRPO steps on any parallel layout.

Run in every rank by `rlfleet.trainer.launch.launch_ranks` (or in the test process for one rank).
Rank 0 builds each step's batch on-policy (log-probs from the trainer's own forward, which every
rank joins), trains, and exports the final weights; it returns the per-step losses and the snapshot.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

PROMPTS_PER_STEP = 8


def make_batch(trainer: Any, step: int) -> list:
    import torch

    from rlfleet.trainer import grpo
    from rlfleet.trainer.tasks import ProblemStream, TaskSpec

    groups = []
    for i, problem in enumerate(ProblemStream(TaskSpec("rotate"), seed=step).take(PROMPTS_PER_STEP)):
        prompt = list(problem.prompt.encode())
        group = []
        for reward, text in ((1.0, problem.answer), (0.0, problem.answer[::-1] + "x")):
            response = list(text.encode())
            ids = torch.tensor([prompt + response])
            logprobs = grpo.token_logprobs(trainer.logits(ids), ids)[0][len(prompt) - 1:].tolist()
            group.append(grpo.Sample(tuple(prompt), tuple(response), tuple(logprobs), weight_version=str(trainer.step),
                                     reward=reward, group_id=f"{step}-{i}"))
        groups.append(group)
    return list(grpo.assemble_batch(groups, current_step=trainer.step, policy=grpo.StalenessPolicy(0)).samples)


def train_steps(backend: str, model_dir: str, layout: tuple[int, int, int], steps: int, out_dir: str,
                fail_rank: int | None = None) -> dict[str, Any] | None:
    """`steps` GRPO steps on `layout` (tensor, pipeline, data); rank 0 returns losses, grad norms, snapshot."""
    import time

    from rlfleet.trainer.base import build_trainer
    from rlfleet.trainer.parallel import ParallelLayout
    from rlfleet.trainer.ranks import LeadingTrainer, follow, init_process_group, rank_env

    started = time.perf_counter()
    parallel = ParallelLayout(*layout)
    rank = rank_env()[0]
    if parallel.world > 1:
        init_process_group("cpu")
    if fail_rank is not None and rank == fail_rank:
        print(f"rank {rank}: failing on purpose", flush=True)
        raise SystemExit(3)
    trainer = build_trainer(backend, model_dir, lr=1e-2, seed=0, parallel=parallel)
    if rank != 0:
        follow(trainer)
        return None
    lead: Any = LeadingTrainer(trainer) if parallel.world > 1 else trainer
    try:
        losses, norms = [], []
        for step in range(steps):
            metrics = lead.train_step(make_batch(lead, step))
            losses.append(metrics["loss"])
            norms.append(metrics["grad_norm"])
        snapshot = lead.export_hf(Path(out_dir) / f"step_{lead.step}", lead.step)
    finally:
        if parallel.world > 1:
            lead.close()
    return {"losses": losses, "grad_norms": norms, "snapshot": str(snapshot),
            "seconds": time.perf_counter() - started}
