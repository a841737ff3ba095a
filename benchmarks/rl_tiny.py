"""How fast GRPO improves the tiny model on a string task, with rollouts from the trainer's own generate.

No engines: this tunes task and RL settings for the quickstart (which samples with SGLang). For
each setting and seed it trains from a fresh tiny model and prints the mean sampled reward over
the first and last `--window` steps, the greedy eval score before and after, and the ratio of
end to start (the baseline is the same run's untrained model).

    python benchmarks/rl_tiny.py --steps 30 --seeds 0 1 2 --lr 3e-3 1e-2
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path


def run_one(args: argparse.Namespace, *, lr: float, group_size: int, prompts: int, seed: int, model_root: Path) -> dict:
    import torch
    from local_rollout import SamplingSettings, greedy_scores, rollout_groups
    from transformers import AutoTokenizer

    from rlfleet.trainer import grpo
    from rlfleet.trainer.base import build_trainer
    from rlfleet.trainer.tasks import ProblemStream, TaskSpec, eval_problems, load_reward_fn
    from rlfleet.trainer.tiny import ensure_tiny_model

    torch.manual_seed(seed)
    model_dir = ensure_tiny_model(model_root / f"tiny-{args.arch}-seed{seed}", seed=seed, arch=args.arch)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = build_trainer(
        args.backend, model_dir, lr=lr, seed=seed,
        loss=grpo.LossConfig(temperature=args.temperature),
    )
    spec = TaskSpec(args.task, alphabet=args.alphabet, min_len=args.min_len, max_len=args.max_len)
    reward_fn = load_reward_fn(args.reward)
    stream = ProblemStream(spec, seed)
    evals = eval_problems(spec, args.eval_size)
    settings = SamplingSettings(group_size=group_size, max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    policy = grpo.StalenessPolicy(max_staleness=0)
    eval_before = greedy_scores(trainer, tokenizer, evals, args.max_new_tokens, reward_fn)
    rewards, step_times, rollout_times = [], [], []
    for _ in range(args.steps):
        started = time.perf_counter()
        groups = rollout_groups(trainer, tokenizer, stream.take(prompts), settings, reward_fn)
        rollout_times.append(time.perf_counter() - started)
        batch = grpo.assemble_batch(groups, current_step=trainer.step, policy=policy,
                                    scale_by_std=not args.no_std_scale)
        rewards.append(batch.reward_mean)
        metrics = trainer.train_step(batch.samples)
        step_times.append(metrics["step_seconds"])
    eval_after = greedy_scores(trainer, tokenizer, evals, args.max_new_tokens, reward_fn)
    w = args.window
    return {
        "start": statistics.fmean(rewards[:w]),
        "end": statistics.fmean(rewards[-w:]),
        "eval_before": eval_before,
        "eval_after": eval_after,
        "train_s": statistics.fmean(step_times),
        "rollout_s": statistics.fmean(rollout_times),
        "curve": rewards,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["torch"], default="torch")
    parser.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    parser.add_argument("--task", default="reverse")
    parser.add_argument("--alphabet", default="abcd")
    parser.add_argument("--min-len", type=int, default=3)
    parser.add_argument("--max-len", type=int, default=3)
    parser.add_argument("--reward", default="rlfleet.trainer.tasks:positional_match")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--window", type=int, default=3, help="steps averaged for the start and end figures")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-2])
    parser.add_argument("--group-size", type=int, nargs="+", default=[8])
    parser.add_argument("--prompts-per-step", type=int, nargs="+", default=[8])
    parser.add_argument("--max-new-tokens", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--eval-size", type=int, default=64)
    parser.add_argument("--no-std-scale", action="store_true", help="advantages r - mean (Dr. GRPO)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--curves", action="store_true", help="print each run's per-step reward")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    print(f"task={args.task} alphabet={args.alphabet} len={args.min_len}-{args.max_len} reward={args.reward} "
          f"steps={args.steps} max_new_tokens={args.max_new_tokens} temperature={args.temperature}")
    print(f"{'lr':>8} {'group':>5} {'prompts':>7} {'seed':>4} | {'reward start':>12} {'end':>6} {'ratio':>6} | "
          f"{'greedy before':>13} {'after':>6} | {'train s/step':>12} {'rollout s/step':>14}")
    with tempfile.TemporaryDirectory() as tmp:
        for lr, group, prompts in itertools.product(args.lr, args.group_size, args.prompts_per_step):
            results = []
            for seed in args.seeds:
                r = run_one(args, lr=lr, group_size=group, prompts=prompts, seed=seed, model_root=Path(tmp))
                results.append(r)
                ratio = r["end"] / r["start"] if r["start"] > 0 else float("inf")
                print(f"{lr:>8g} {group:>5} {prompts:>7} {seed:>4} | "
                      f"{r['start']:>12.3f} {r['end']:>6.3f} {ratio:>6.1f} | "
                      f"{r['eval_before']:>13.3f} {r['eval_after']:>6.3f} | "
                      f"{r['train_s']:>12.4f} {r['rollout_s']:>14.4f}",
                      flush=True)
                if args.curves:
                    print("   curve:", " ".join(f"{x:.2f}" for x in r["curve"]))
            start = statistics.fmean(r["start"] for r in results)
            end = statistics.fmean(r["end"] for r in results)
            after = statistics.fmean(r["eval_after"] for r in results)
            print(f"{lr:>8g} {group:>5} {prompts:>7} mean | {start:>12.3f} {end:>6.3f} "
                  f"{(end / start if start else float('inf')):>6.1f} | {'':>13} {after:>6.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
