"""Checkpoint cost: seconds a checkpoint holds the training loop, and seconds writing it takes beside it.

For the tiny model and for a generated ~1 GB (float32 weights) Llama, each with AdamW state after one
step: the baseline is the time to copy the trainer's state off the device (`capture_state` called
directly), measured in the same run; the figure is what `RunCheckpoints.save` holds the asyncio loop
(the copy in a thread, plus any previous write still going), with a simulated training step between
checkpoints (before each checkpoint the copy alone is timed, the previous write finished, so both see
the same memory). Goal: held <= copy + 5%.

With `--ranks N` the trainer is N real ranks (gloo, the elastic launcher; megatron tensor parallel N,
or torch data parallel N): rank 0's loop is held while every rank is told to copy its state and rank 0
copies its own; each rank writes its own shard beside the next steps and rank 0 the marker once every
rank reported. The baseline is rank 0's copy of its own state alone.

    python benchmarks/bench_checkpoint.py                      # tiny and ~1 GB
    python benchmarks/bench_checkpoint.py --sizes tiny --checkpoints 5
    python benchmarks/bench_checkpoint.py --sizes tiny --backend megatron --ranks 2
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

# ~1.0 GB of float32 weights: 16 layers of hidden 1024 / MLP 4096 (GQA 16/4 heads).
LARGE = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=16,
             num_key_value_heads=4)


def large_model(root: Path) -> Path:
    """The ~1 GB model, generated once (random weights, the tiny model's tokenizer) under root."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from rlfleet.trainer import tiny

    out = root / "bench-llama-1gb"
    marker = out / "rlfleet-bench.json"
    if marker.exists() and json.loads(marker.read_text()) == LARGE:
        return out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    settings = {**tiny.MODEL_SETTINGS, **LARGE}
    config = LlamaConfig(attention_bias=False, mlp_bias=False, eos_token_id=256, bos_token_id=257, pad_token_id=258,
                         torch_dtype="float32", **settings)
    AutoModelForCausalLM.from_config(config).to(torch.float32).save_pretrained(out, safe_serialization=True)
    tiny.build_tokenizer().save_pretrained(out)
    marker.write_text(json.dumps(LARGE))
    return out


def one_step(trainer) -> None:
    """One real optimizer step, so the optimizer holds its moments (a checkpoint's usual size)."""
    from rlfleet.trainer import grpo

    group = [grpo.Sample((97, 98, 99, 61), (98, 99, 100), (-1.0, -1.0, -1.0), "0", reward=r) for r in (0.0, 1.0)]
    trainer.train_step(list(grpo.assemble_batch([group], current_step=0, policy=grpo.StalenessPolicy(1)).samples))


async def measure(trainer, root: Path, checkpoints: int, step_seconds: float) -> dict[str, float]:
    from rlfleet.crds.specs import CheckpointSpec
    from rlfleet.orchestrator.run.checkpointing import RunCheckpoints
    from rlfleet.trainer import checkpoint as ckpt
    from rlfleet.trainer import rank_checkpoints
    from rlfleet.trainer.ranks import LeadingTrainer

    layout = trainer.options.parallel
    run = RunCheckpoints("bench", CheckpointSpec(interval_steps=1, keep=2), root,
                         ckpt.Identity(run="bench", model_path="bench", backend=trainer.backend,
                                       world_size=layout.world, tensor_parallel=layout.tensor,
                                       pipeline_parallel=layout.pipeline))
    # Rank 0's own copy (the other ranks copy theirs at the same time, in their own processes).
    own_copy = (functools.partial(rank_checkpoints.capture, trainer.local) if isinstance(trainer, LeadingTrainer)
                else functools.partial(ckpt.capture_state, trainer))
    copies, held = [], []
    for step in range(1, checkpoints + 1):
        # The baseline, under the same conditions (the previous write done, memory as it is now): the
        # copy off the device and nothing else.
        await run.wait()
        started = time.perf_counter()
        copy = own_copy()
        copies.append(time.perf_counter() - started)
        del copy
        gc.collect()
        held.append(await run.save(trainer, step, {"step": step}))
        await asyncio.sleep(0)
        await asyncio.to_thread(time.sleep, step_seconds)  # the next training step, beside the write
    await run.close()
    writes = [c["write_seconds"] for c in run.written]
    size = sum(p.stat().st_size for p in ckpt.step_dir(root, checkpoints).iterdir())
    if len(writes) != checkpoints:
        raise RuntimeError(f"{checkpoints - len(writes)} checkpoint(s) failed")
    return {"copy": statistics.median(copies), "held": statistics.median(held), "held_max": max(held),
            "write": statistics.median(writes), "bytes": size}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=("tiny", "1gb"), default=["tiny", "1gb"])
    parser.add_argument("--checkpoints", type=int, default=4)
    parser.add_argument("--step-seconds", type=float, default=None,
                        help="simulated training step between checkpoints (default: 1 s tiny, 20 s 1gb)")
    parser.add_argument("--backend", choices=("torch", "megatron"), default="torch")
    parser.add_argument("--dir", type=Path, help="where checkpoints are written (default: a temporary directory)")
    parser.add_argument("--ranks", type=int, default=1,
                        help="trainer ranks (megatron: tensor parallel, torch: data parallel); default 1")
    args = parser.parse_args(argv)
    if args.ranks > 1:
        return main_ranks(args)

    from rlfleet.trainer.base import build_trainer
    from rlfleet.trainer.tiny import ensure_tiny_model
    from rlfleet.util.binaries import CACHE_DIR

    print(f"{'model':>6} {'checkpoint MB':>13} {'copy s (baseline)':>18} {'loop held s':>12} {'ratio':>6} "
          f"{'held max s':>10} {'write s':>8}")
    for size in args.sizes:
        model = (ensure_tiny_model(CACHE_DIR / "models" / "tiny-llama-seed0") if size == "tiny"
                 else large_model(CACHE_DIR / "models"))
        trainer = build_trainer(args.backend, model, lr=1e-4, seed=0)
        one_step(trainer)
        step_s = args.step_seconds if args.step_seconds is not None else (1.0 if size == "tiny" else 20.0)
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            r = asyncio.run(measure(trainer, Path(tmp), args.checkpoints, step_s))
        print(f"{size:>6} {r['bytes'] / 1e6:>13.1f} {r['copy']:>18.4f} {r['held']:>12.4f} "
              f"{r['held'] / max(r['copy'], 1e-9):>6.2f} {r['held_max']:>10.4f} {r['write']:>8.2f}")
        del trainer
    print("goal: loop held <= copy off the device + 5% (ratio <= 1.05)")
    return 0


def _rank_entry(model: str, backend: str, ranks: int, checkpoints: int, step_s: float,
                directory: str | None) -> dict[str, float] | None:
    """Every rank: the trainer of `ranks`; rank 0 measures, the others follow its commands."""
    from rlfleet.trainer.base import build_trainer
    from rlfleet.trainer.parallel import ParallelLayout
    from rlfleet.trainer.ranks import LeadingTrainer, follow, init_process_group, rank_env

    init_process_group("cpu")
    layout = ParallelLayout(tensor=ranks) if backend == "megatron" else ParallelLayout(data=ranks)
    trainer = build_trainer(backend, model, lr=1e-4, seed=0, parallel=layout)
    if rank_env()[0] != 0:
        follow(trainer)
        return None
    lead = LeadingTrainer(trainer)
    try:
        one_step(lead)
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            return asyncio.run(measure(lead, Path(tmp), checkpoints, step_s))
    finally:
        lead.close()


def main_ranks(args) -> int:
    from rlfleet.trainer.launch import launch_ranks
    from rlfleet.trainer.tiny import ensure_tiny_model
    from rlfleet.util.binaries import CACHE_DIR

    kind = "tensor" if args.backend == "megatron" else "data"
    print(f"{args.backend}, {args.ranks} ranks ({kind} parallel, gloo); baseline: rank 0's own copy")
    print(f"{'model':>6} {'checkpoint MB':>13} {'copy s (baseline)':>18} {'loop held s':>12} {'ratio':>6} "
          f"{'held max s':>10} {'write s':>8}")
    for size in args.sizes:
        model = (ensure_tiny_model(CACHE_DIR / "models" / "tiny-llama-seed0") if size == "tiny"
                 else large_model(CACHE_DIR / "models"))
        step_s = args.step_seconds if args.step_seconds is not None else (1.0 if size == "tiny" else 20.0)
        with tempfile.TemporaryDirectory() as logs:
            r = launch_ranks(_rank_entry, (str(model), args.backend, args.ranks, args.checkpoints, step_s,
                                           str(args.dir) if args.dir else None),
                             world=args.ranks, log_dir=Path(logs))[0]
        print(f"{size:>6} {r['bytes'] / 1e6:>13.1f} {r['copy']:>18.4f} {r['held']:>12.4f} "
              f"{r['held'] / max(r['copy'], 1e-9):>6.2f} {r['held_max']:>10.4f} {r['write']:>8.2f}")
    print("goal: loop held <= copy off the device + 5% (ratio <= 1.05)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
