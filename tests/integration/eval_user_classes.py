"""User-level evaluators (posture external) used by the eval tests: real CheckpointEvalFn classes that
read the snapshot they are given. Loaded by class path, as a TrainingRun names them."""
from __future__ import annotations

import asyncio
from pathlib import Path

from rlfleet.orchestrator.evaluation.api import CheckpointEvalFn, EvalSkip


def weight_score(checkpoint_dir: str) -> float:
    """A checkpoint-dependent number: the mean absolute value of the embedding weights."""
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    embed = next(t for name, t in tensors.items() if "embed_tokens" in name)
    return float(embed.float().abs().mean())


class SlowWeightNormEval(CheckpointEvalFn):
    """Scores the checkpoint, then takes `delay_s` more (a slow judge)."""

    def __init__(self, delay_s: float = 2.0):
        self.delay_s = delay_s
        self.seen: list[tuple[str, str]] = []
        self.disposed = False

    async def evaluate_checkpoint(self, checkpoint_dir, request):
        score = await asyncio.to_thread(weight_score, checkpoint_dir)
        self.seen.append((checkpoint_dir, request.weight_version))
        await asyncio.sleep(self.delay_s)
        return {"weights": score}

    def dispose(self):
        self.disposed = True


class CrashingEval(CheckpointEvalFn):
    """Reads the checkpoint, then fails like a buggy evaluator (every `crash_every`-th point skips instead)."""

    def __init__(self, skip_steps: tuple[int, ...] = ()):
        self.skip_steps = set(skip_steps)
        self.calls = 0

    def evaluate_checkpoint(self, checkpoint_dir, request):  # a plain method: run in a thread
        self.calls += 1
        weight_score(checkpoint_dir)
        if request.step in self.skip_steps:
            raise EvalSkip("judge_down", "the judge answered 502")
        raise RuntimeError(f"evaluator bug at step {request.step}")
