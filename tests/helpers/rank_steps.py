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


def trainer_label(label: str) -> tuple[str, str]:
    """(backend, data-parallel mode) of a label naming the mode after a dash: "torch-fsdp" -> torch, fsdp;
    "megatron" -> megatron, ddp."""
    backend, _, mode = label.partition("-")
    return backend, mode or "ddp"


def train_steps(backend: str, model_dir: str, layout: tuple[int, int, int], steps: int, out_dir: str,
                fail_rank: int | None = None, micro_batch: int | None = None,
                samples: int | None = None, kl_coef: float = 0.0) -> dict[str, Any] | None:
    """`steps` GRPO steps on `layout` (tensor, pipeline, data); rank 0 returns losses, grad norms,
    every step's statistics (its metrics but the time), snapshot. `backend` may name the data-parallel
    mode after a dash ("torch-fsdp"). `micro_batch`: samples per forward/backward pass; `samples`: each
    step's batch cut to that many; `kl_coef` > 0: a KL penalty to the initial weights."""
    import time

    from rlfleet.trainer import grpo
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
    backend, mode = trainer_label(backend)
    trainer = build_trainer(backend, model_dir, lr=1e-2, seed=0, parallel=parallel, data_parallel_mode=mode,
                            micro_batch_size=micro_batch, loss=grpo.LossConfig(kl_coef=kl_coef))
    if rank != 0:
        follow(trainer)
        return None
    lead: Any = LeadingTrainer(trainer) if parallel.world > 1 else trainer
    try:
        # Every step's batch is scored by the initial weights: from step 2 on the samples are off-policy,
        # so the loss (through the importance ratios) depends on the weights the earlier steps made.
        batches = [make_batch(lead, step)[:samples] for step in range(steps)]
        losses, norms, stats = [], [], []
        for batch in batches:
            metrics = lead.train_step(batch)
            losses.append(metrics["loss"])
            norms.append(metrics["grad_norm"])
            stats.append({k: v for k, v in metrics.items() if k != "step_seconds"})
        snapshot = lead.export_hf(Path(out_dir) / f"step_{lead.step}", lead.step)
    finally:
        if parallel.world > 1:
            lead.close()
    return {"losses": losses, "grad_norms": norms, "stats": stats, "snapshot": str(snapshot),
            "seconds": time.perf_counter() - started}


def fail_in_step(model_dir: str, out_dir: str) -> None:
    """Rank 0's part of a step raises while the other replica trains its part and then waits for rank 0
    in the step's reductions (torch DDP, dataParallelSize 2): replica 0's samples alone hold a token
    outside the vocabulary. Every rank writes its pid to `out_dir`/pid-<rank>; rank 0 writes the time
    its step began to `out_dir`/step-began."""
    import dataclasses
    import os
    import time

    from rlfleet.trainer.base import build_trainer
    from rlfleet.trainer.parallel import ParallelLayout
    from rlfleet.trainer.ranks import LeadingTrainer, follow, init_process_group, rank_env

    out = Path(out_dir)
    parallel = ParallelLayout(1, 1, 2)
    init_process_group("cpu")
    rank = rank_env()[0]
    (out / f"pid-{rank}").write_text(str(os.getpid()))
    trainer = build_trainer("torch", model_dir, lr=1e-2, seed=0, parallel=parallel)
    if rank != 0:
        follow(trainer)
        return
    lead = LeadingTrainer(trainer)
    try:
        batch = make_batch(lead, 0)
        first = batch[0]  # replica 0 trains the first half of the batch
        outside = dataclasses.replace(first, response_ids=(10**6, *first.response_ids[1:]))
        (out / "step-began").write_text(str(time.time()))
        lead.train_step([outside, *batch[1:]])
    finally:
        lead.close()


def replay_run(manifest: str, batch_files: list[str], checkpoint_dir: str, moved_since: int) -> dict[str, Any] | None:
    """A trainer that never stopped: built as `rlfleet run MANIFEST` builds it (every rank, in its
    layout), trained on a run's recorded batches in order (every rank reads them; each trains its
    data-parallel part). Rank 0 returns each step's (loss, gradient norm), the largest difference of
    any rank's weights after the last step from that rank's in the checkpoint `checkpoint_dir`, and
    how far the weights moved after step `moved_since` (so the comparison can tell runs apart)."""
    import json

    import torch

    from rlfleet.crds.loader import load_training_run
    from rlfleet.orchestrator.run.loop import resolve_model_dir
    from rlfleet.orchestrator.run.trainer_setup import build_rank_trainer
    from rlfleet.trainer import checkpoint as ckpt
    from rlfleet.trainer import grpo
    from rlfleet.trainer.ranks import BatchShards, rank_env, train_part

    spec = load_training_run(manifest).spec
    trainer: Any = build_rank_trainer(spec, resolve_model_dir(spec.model_path))
    model, _ = trainer.checkpoint_objects()
    rank = rank_env()[0]
    steps, before = [], None
    for step, path in enumerate(batch_files, start=1):
        samples = [grpo.Sample(**{**s, "prompt_ids": tuple(s["prompt_ids"]), "response_ids": tuple(s["response_ids"]),
                                  "sampling_logprobs": tuple(s["sampling_logprobs"])})
                   for s in json.loads(Path(path).read_text())["samples"]]
        stats = train_part(trainer, BatchShards(samples, trainer.options.parallel.data))
        steps.append((stats["loss"], stats["grad_norm"]))
        if step == moved_since:
            before = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert before is not None, f"fewer than {moved_since} batches"
    info = ckpt.validate(checkpoint_dir)
    saved = ckpt.load_shard(info, ckpt.source_rank(rank, ckpt.layout_of(info.meta)))["model"]
    now = {k: v.detach() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert set(saved) == set(now), sorted(set(saved) ^ set(now))[:5]
    figures = torch.tensor([max(float((saved[k].float() - now[k].float()).abs().max()) for k in now),
                            max(float((now[k] - before[k]).abs().max()) for k in now)])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(figures, op=torch.distributed.ReduceOp.MAX)
    if rank != 0:
        return None
    return {"steps": steps, "worst": float(figures[0]), "moved": float(figures[1])}


def relay_commands(commands: list[tuple]) -> list[tuple] | None:
    """Rank 0 sends each command over the trainer's command channel; every other rank returns what it
    received, in order."""
    from rlfleet.trainer import ranks

    ranks.init_process_group("cpu")
    channel = ranks._Commands()
    if ranks.rank_env()[0] == 0:
        for command in commands:
            channel.send(*command)
        return None
    return [channel.receive() for _ in commands]


def checkpoint_round_trip(backend: str, model_dir: str, layout: tuple[int, int, int], out_dir: str,
                          before: int = 2, after: int = 2) -> dict[str, Any] | None:
    """`before` steps, a checkpoint of every rank's shard, `after` steps, the checkpoint restored, the same
    `after` steps again. Rank 0 returns the losses, the checkpoint's directory and the fraction of the
    model's weights and of the optimizer's moments this rank holds. `backend` as `train_steps` takes it."""
    from rlfleet.trainer import checkpoint as ckpt
    from rlfleet.trainer.base import build_trainer
    from rlfleet.trainer.parallel import ParallelLayout
    from rlfleet.trainer.ranks import LeadingTrainer, follow, init_process_group, rank_env

    parallel = ParallelLayout(*layout)
    init_process_group("cpu")
    name, mode = trainer_label(backend)
    trainer = build_trainer(name, model_dir, lr=1e-2, seed=0, parallel=parallel, data_parallel_mode=mode)
    if rank_env()[0] != 0:
        follow(trainer)
        return None
    lead: Any = LeadingTrainer(trainer)
    try:
        batches = [make_batch(lead, step) for step in range(before + after)]
        first = [lead.train_step(b)["loss"] for b in batches[:before]]
        identity = ckpt.Identity(run="round-trip", model_path=model_dir, backend=name, world_size=parallel.world,
                                 tensor_parallel=parallel.tensor, pipeline_parallel=parallel.pipeline)
        directory = ckpt.prepare_step_dir(out_dir, lead.step)
        state = lead.capture_checkpoint(directory)
        ckpt.check_shard_reports(lead.step, lead.write_checkpoint_shard(directory, state), parallel.world)
        info = ckpt.finalize(directory, identity=identity, step=lead.step, weight_version=str(lead.step),
                             run_state={})
        then = [lead.train_step(b)["loss"] for b in batches[before:]]
        lead.restore_checkpoint(ckpt.validate(info.directory))
        again = [lead.train_step(b)["loss"] for b in batches[before:]]
    finally:
        lead.close()

    def local(t: Any) -> int:
        return int(t.to_local().numel() if hasattr(t, "to_local") else t.numel())

    model, optimizer = trainer.checkpoint_objects()
    whole = sum(p.numel() for p in model.parameters())  # a sharded parameter's numel is the whole tensor's
    moments = [s["exp_avg"] for s in optimizer.state.values()]
    return {"before": first, "after": then, "again": again, "checkpoint": str(info.directory),
            "batches": batches[before:],
            "weights_held": sum(local(p) for p in model.parameters()) / whole,
            "moments_held": sum(local(m) for m in moments) / sum(m.numel() for m in moments)}
