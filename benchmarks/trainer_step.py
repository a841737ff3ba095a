"""Seconds per GRPO train step, weight copy-out and HF export, for each trainer backend on the tiny model.

The batch has the quickstart's shape (prompts x group samples, short prompts and answers). The
baseline is the torch backend measured in the same run; megatron is printed as a ratio to it.

    python benchmarks/trainer_step.py --steps 20 --prompts 16 --group 16
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path


def make_batch(prompts: int, group: int, seed: int) -> list:
    from rlfleet.trainer import grpo
    from rlfleet.trainer.tasks import ProblemStream, TaskSpec

    rng = random.Random(seed)
    groups = []
    for i, problem in enumerate(ProblemStream(TaskSpec("reverse"), seed).take(prompts)):
        prompt = tuple(problem.prompt.encode())
        samples = []
        for _ in range(group):
            response = tuple(rng.choice(b"abcd") for _ in problem.answer)
            samples.append(grpo.Sample(prompt, response, tuple(-1.4 for _ in response), "0",
                                       reward=rng.random(), group_id=str(i)))
        groups.append(samples)
    return list(grpo.assemble_batch(groups, current_step=0, policy=grpo.StalenessPolicy(1)).samples)


def measure(backend: str, model_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    from rlfleet.trainer.base import build_trainer

    started = time.perf_counter()
    trainer = build_trainer(backend, model_dir, lr=1e-3, seed=0)
    build_s = time.perf_counter() - started
    batch = make_batch(args.prompts, args.group, 0)
    trainer.train_step(batch)  # warm-up
    steps = [trainer.train_step(batch)["step_seconds"] for _ in range(args.steps)]
    copies, exports = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(3):
            t0 = time.perf_counter()
            trainer.state_for_export()
            copies.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            trainer.export_hf(Path(tmp) / f"step_{i}", i)
            exports.append(time.perf_counter() - t0)
    return {"build": build_s, "step": statistics.median(steps), "copy": statistics.median(copies),
            "export": statistics.median(exports)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    import torch

    from rlfleet.trainer.tiny import ensure_tiny_model

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = ensure_tiny_model(Path(tmp) / "tiny", seed=0)
        results = {b: measure(b, model_dir, args) for b in ("torch", "megatron")}
    base = results["torch"]
    print(f"batch {args.prompts} prompts x {args.group} samples, {args.steps} steps, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'backend':>9} | {'build s':>8} | {'train step s':>12} {'x torch':>7} | "
          f"{'copy-out s':>10} | {'export s':>8}")
    for name, r in results.items():
        print(f"{name:>9} | {r['build']:>8.2f} | {r['step']:>12.4f} {r['step'] / base['step']:>7.2f} | "
              f"{r['copy']:>10.5f} | {r['export']:>8.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
