"""Rank entry points for the multi-rank trainer tests: the same GRPO steps on any parallel layout.

Run in every rank by `rlfleet.trainer.launch.launch_ranks` (or in the test process for one rank).
Rank 0 scores every step's batch with the initial weights (the trainer's own forward, which every rank
joins), trains, and exports the final weights; it returns the per-step losses, gradient norms and the
snapshot.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

PROMPTS_PER_STEP = 8
MAX_STEPS = 16


def make_batch(trainer: Any, step: int) -> list:
    """Per prompt the right answer (reward 1) and a wrong one (reward 0), log-probs on-policy (one forward)."""
    import torch

    from rlfleet.trainer import grpo
    from rlfleet.trainer.tasks import ProblemStream, TaskSpec

    pairs = []
    for i, problem in enumerate(ProblemStream(TaskSpec("rotate"), seed=step).take(PROMPTS_PER_STEP)):
        prompt = list(problem.prompt.encode())
        for reward, text in ((1.0, problem.answer), (0.0, problem.answer[::-1] + "x")):
            pairs.append((i, prompt, list(text.encode()), reward))
    length = max(len(p) + len(r) for _, p, r, _ in pairs)
    ids = torch.full((len(pairs), length), trainer.pad_id, dtype=torch.long)
    for row, (_, prompt, response, _) in enumerate(pairs):
        ids[row, : len(prompt) + len(response)] = torch.tensor(prompt + response)
    logprobs = grpo.token_logprobs(trainer.logits(ids), ids)
    groups: dict[int, list] = {}
    for row, (i, prompt, response, reward) in enumerate(pairs):
        lp = logprobs[row, len(prompt) - 1 : len(prompt) - 1 + len(response)].tolist()
        groups.setdefault(i, []).append(grpo.Sample(tuple(prompt), tuple(response), tuple(lp),
                                                    weight_version=str(trainer.step), reward=reward,
                                                    group_id=f"{step}-{i}"))
    return list(grpo.assemble_batch(groups.values(), current_step=trainer.step,
                                    policy=grpo.StalenessPolicy(MAX_STEPS)).samples)


def train_layouts(runs: list[tuple[str, tuple[int, int, int]]], model_dir: str, steps: int,
                  out_dir: str) -> list[dict[str, Any] | None]:
    """`train_steps` for each (backend, layout) in turn, in the same ranks (megatron state reset between)."""
    results = []
    for i, (backend, layout) in enumerate(runs):
        results.append(train_steps(backend, model_dir, layout, steps, str(Path(out_dir) / f"{i}-{backend}")))
        if backend == "megatron":
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
    return results


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
        # Every step's batch is scored by the initial weights: from step 2 on the samples are off-policy,
        # so the loss (through the importance ratios) depends on the weights the earlier steps made.
        batches = [make_batch(lead, step) for step in range(steps)]
        losses, norms = [], []
        for batch in batches:
            metrics = lead.train_step(batch)
            losses.append(metrics["loss"])
            norms.append(metrics["grad_norm"])
        snapshot = lead.export_hf(Path(out_dir) / f"step_{lead.step}", lead.step)
    finally:
        if parallel.world > 1:
            lead.close()
    return {"losses": losses, "grad_norms": norms, "snapshot": str(snapshot),
            "seconds": time.perf_counter() - started}
