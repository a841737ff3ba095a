"""Benchmark: what evaluation (posture fleet) costs the training loop.

Real runs in this process, same manifest and seed (`rlfleet run`'s LocalRun: real SGLang CPU
engines, the real router, the torch trainer), alternated in pairs: eval off (the baseline), then eval
on with a dedicated eval fleet of one engine, a point every `--interval` steps, backpressure.

Figures:
- step time with eval on vs off (mean and median over the steps after the eval fleet served its
  first point, so engine start-up is not counted): the overhead ratio. On a small CPU machine the eval
  engine shares the cores with the rollout engine and the trainer, so this ratio includes that
  contention; with its own devices (GPU clusters) only the next figure remains;
- the time the training loop itself was held by evaluation: taking the weights off the device for each
  snapshot plus any backpressure wait, per step, as a share of the step time (goal <= 2%);
- export (written beside training) and evaluation seconds per point.

Run: python benchmarks/bench_eval_overhead.py [--steps 20] [--interval 5] [--pairs 2] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_run(name: str, steps: int, interval: int, volume: Path, eval_on: bool):
    from rlfleet.crds.eval_specs import EvalDatasetSpec, EvalFleetTemplateSpec, EvalSpec
    from rlfleet.crds.loader import load_training_run

    run = load_training_run(ROOT / "examples" / "quickstart.yaml")
    run.metadata.name = name
    spec = run.spec
    spec.trainer.steps = steps
    spec.rollout.replicas = 1
    spec.rollout.min_ready_engines = 1
    spec.weight_sync.snapshot_volume.local_path = str(volume)
    spec.eval = EvalSpec(
        posture="fleet", interval_steps=interval, eval_before_train=True, max_in_flight=2,
        overflow_policy="backpressure", keep_snapshots=2,
        datasets=[EvalDatasetSpec(name="reverse", task="reverse", max_prompts=16, max_new_tokens=8)],
        fleet=EvalFleetTemplateSpec(replicas=1, min_ready_engines=1)) if eval_on else None
    return run


async def one_run(name: str, steps: int, interval: int, work: Path, eval_on: bool) -> dict:
    from rlfleet.orchestrator.run.local import LocalRun, RunOptions
    from rlfleet.orchestrator.run.progress import ProgressReporter

    run = build_run(name, steps, interval, work / name / "volume", eval_on)
    local = LocalRun(run, RunOptions(run_dir=work / name / "run", metrics_port=0,
                                     progress=ProgressReporter(io.StringIO(), tty=False)))
    summary = await local.execute()
    seconds = {s.step: s.seconds for s in summary.steps}
    result = {"step_seconds": seconds}
    if eval_on:
        evaluation = local.evaluation
        points = evaluation.points
        scored = [p for p in points if not p.skipped]
        # Steps after the eval fleet served its first point (its start-up shares the CPU otherwise).
        first_served = min((p.step + p.lag_steps for p in scored), default=0)
        result.update({
            "first_step_measured": first_served + 1,
            "loop_held_s": dict(evaluation.loop_held_s),
            "eval_points": len(points),
            "eval_skipped": {p.step: p.skipped for p in points if p.skipped},
            "export_write_s": [p.export_seconds for p in scored if p.export_seconds is not None],
            "eval_s": [p.seconds for p in scored if p.seconds is not None],
            "mixed_version_ratio_max": max((p.mixed_version_ratio or 0.0) for p in scored) if scored else None,
        })
    return result


async def bench(steps: int, interval: int, pairs: int) -> dict:
    offs, ons = [], []
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-eval-") as tmp:
        work = Path(tmp)
        for pair in range(pairs):  # alternate, so load drifting on a shared machine hits both alike
            offs.append(await one_run(f"bench-eval-off-{pair}", steps, interval, work, eval_on=False))
            ons.append(await one_run(f"bench-eval-on-{pair}", steps, interval, work, eval_on=True))
    off_steps, on_steps, held, eval_steps = [], [], [], []
    for off, on in zip(offs, ons, strict=True):
        first = on["first_step_measured"]
        off_steps += [s for step, s in off["step_seconds"].items() if step >= first]
        on_steps += [s for step, s in on["step_seconds"].items() if step >= first]
        held += [h for step, h in on["loop_held_s"].items() if step >= first]
        eval_steps += [h for step, h in on["loop_held_s"].items() if step >= first and step % interval == 0]
    held_per_step = sum(held) / len(on_steps)
    return {
        "steps": steps, "interval": interval, "pairs": pairs,
        "measured_steps_per_side": len(on_steps),
        "off_step_mean_s": statistics.fmean(off_steps), "off_step_median_s": statistics.median(off_steps),
        "on_step_mean_s": statistics.fmean(on_steps), "on_step_median_s": statistics.median(on_steps),
        "step_time_ratio_mean": statistics.fmean(on_steps) / statistics.fmean(off_steps),
        "step_time_ratio_median": statistics.median(on_steps) / statistics.median(off_steps),
        "loop_held_per_step_s": held_per_step,
        "loop_held_per_eval_step_s": statistics.fmean(eval_steps) if eval_steps else 0.0,
        "loop_held_share_of_step": held_per_step / statistics.fmean(on_steps),
        "export_write_mean_s": statistics.fmean(x for on in ons for x in on["export_write_s"]),
        "eval_mean_s": statistics.fmean(x for on in ons for x in on["eval_s"]),
        "eval_points": sum(on["eval_points"] for on in ons),
        "eval_skipped": [on["eval_skipped"] for on in ons],
        "mixed_version_ratio_max": max(on["mixed_version_ratio_max"] or 0.0 for on in ons),
        "runs": {"off": offs, "on": ons},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--interval", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=2, help="off/on run pairs, alternated")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    r = asyncio.run(bench(args.steps, args.interval, args.pairs))
    if args.json:
        print(json.dumps(r, indent=2, default=str))
        return 0
    print(f"eval overhead, posture fleet: {args.pairs} x (off, on) runs of {args.steps} steps, a point every "
          f"{args.interval} steps; {r['measured_steps_per_side']} steps measured per side")
    print(f"  step time, eval off : mean {r['off_step_mean_s']:.3f} s  median {r['off_step_median_s']:.3f} s")
    print(f"  step time, eval on  : mean {r['on_step_mean_s']:.3f} s  median {r['on_step_median_s']:.3f} s")
    print(f"  ratio on/off        : mean {r['step_time_ratio_mean']:.3f}  median {r['step_time_ratio_median']:.3f}"
          "  (on this machine the eval engine shares the CPU cores with rollout and training)")
    print(f"  loop held by eval   : {1000 * r['loop_held_per_step_s']:.2f} ms per step "
          f"({1000 * r['loop_held_per_eval_step_s']:.2f} ms per eval step: weight capture + backpressure) = "
          f"{100 * r['loop_held_share_of_step']:.2f}% of a step (goal <= 2%)")
    print(f"  per point           : export {r['export_write_mean_s']:.3f} s beside training, eval "
          f"{r['eval_mean_s']:.2f} s; {r['eval_points']} points, skipped {r['eval_skipped']}, "
          f"max mixed-version ratio {r['mixed_version_ratio_max']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
