"""`rlfleet run FILE`: run a TrainingRun on this machine with local processes."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path

from rlfleet.crds.loader import ManifestError, load_training_run
from rlfleet.orchestrator.local_run import LocalRun, RunFailed, RunOptions
from rlfleet.orchestrator.progress import ProgressReporter


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlfleet run", description=__doc__.splitlines()[0])
    p.add_argument("file", help="TrainingRun YAML (the same file `kubectl apply` takes)")
    p.add_argument("--summary", type=Path, help="write the run summary (JSON) here")
    p.add_argument("--run-dir", type=Path, help="logs and snapshots (default: runs/<name>-<time>)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (default: the spec's metricsPort; 0: any free port)")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--steps", type=int, help="override spec.trainer.steps")
    p.add_argument("--chaos", action="store_true", help="SIGKILL a random engine now and then, to watch recovery")
    p.add_argument("--chaos-interval", type=float, default=20.0, help="mean seconds between chaos kills")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run = load_training_run(args.file)
    except ManifestError as exc:
        print(f"rlfleet run: {args.file} is not a valid TrainingRun:\n{exc}", file=sys.stderr)
        return 2
    if args.steps is not None:
        if args.steps < 1:
            print("rlfleet run: --steps must be >= 1", file=sys.stderr)
            return 2
        run.spec.trainer.steps = args.steps
    run_dir = args.run_dir or Path("runs") / f"{run.metadata.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    options = RunOptions(run_dir=run_dir, summary_path=args.summary, chaos=args.chaos,
                         chaos_interval_s=args.chaos_interval, metrics_host=args.metrics_host,
                         metrics_port=args.metrics_port, progress=ProgressReporter(),
                         manifest_dir=Path(args.file).resolve().parent)
    try:
        summary = asyncio.run(LocalRun(run, options).execute())
    except RunFailed as exc:
        print(f"rlfleet run: FAILED ({exc.reason}): {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("rlfleet run: interrupted; engines and router stopped", file=sys.stderr)
        return 130
    data = summary.to_dict()
    print(f"rlfleet run: {data['steps_completed']}/{data['steps_planned']} steps, reward "
          f"{data['reward_mean_first']} -> {data['reward_mean_last']}, engines recreated "
          f"{data['engines_recreated']}, {data['wall_seconds']:.0f} s", file=sys.stderr)
    if data["eval"]:
        scored = [p for p in data["eval"] if not p["skipped"]]
        skipped = [f"{p['step']}:{p['skipped']}" for p in data["eval"] if p["skipped"]]
        last = scored[-1] if scored else None
        print(f"rlfleet run: eval {len(scored)}/{len(data['eval'])} points scored"
              + (f", last @{last['step']} {last['scores']}" if last else "")
              + (f", skipped {' '.join(skipped)}" if skipped else "")
              + f", {data['eval_snapshots_left']} eval snapshot(s) left on the volume", file=sys.stderr)
    return 0
