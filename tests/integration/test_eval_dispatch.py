"""The eval dispatcher with real parts and no engine: the torch trainer, real snapshot export to a
volume directory, and user-level evaluator classes loaded by class path, driven the way the run loop
drives it (a training step, then `after_step`)."""
from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from rlfleet.orchestrator.evaluation.api import load_checkpoint_eval_fn
from rlfleet.orchestrator.evaluation.dispatcher import EvalDispatcher, SnapshotVolume, TrainerSnapshotExporter
from rlfleet.orchestrator.evaluation.postures.external import ExternalEvaluator
from rlfleet.snapshot.format import validate_snapshot
from rlfleet.trainer import grpo
from rlfleet.trainer.base import build_trainer

HERE = Path(__file__).parent
STEPS = 6


@pytest.fixture(scope="module")
def trainer(tiny_model):
    return build_trainer("torch", tiny_model, lr=1e-3, seed=0, device="cpu")


def batch(step: int, vocab: int = 40) -> list[grpo.Sample]:
    rng = random.Random(step)
    return [grpo.Sample(prompt_ids=tuple(rng.randrange(3, vocab) for _ in range(4)),
                        response_ids=tuple(rng.randrange(3, vocab) for _ in range(6)),
                        sampling_logprobs=(-3.0,) * 6, weight_version=str(step - 1),
                        reward=float(i % 2), advantage=1.0 if i % 2 else -1.0)
            for i in range(8)]


def evaluator(class_name: str, **args) -> ExternalEvaluator:
    return ExternalEvaluator(load_checkpoint_eval_fn(f"eval_user_classes:{class_name}", args, search_dirs=[HERE]))


async def run_training(trainer, ev: ExternalEvaluator, volume: Path, *, policy: str, max_in_flight: int = 1,
                       keep: int = 2, run: str) -> tuple[EvalDispatcher, list[float]]:
    """STEPS real optimizer steps with an eval point after each; returns the dispatcher and step times."""
    current = {"step": trainer.step}
    base = trainer.step
    dispatcher = EvalDispatcher(
        run=run, evaluator=ev, max_in_flight=max_in_flight, overflow_policy=policy, keep_snapshots=keep,
        interval_steps=1, final_step=base + STEPS, before_train=False, current_step=lambda: current["step"],
        volume=SnapshotVolume(volume), exporter=TrainerSnapshotExporter(trainer.state_for_export))
    step_seconds = []
    for _ in range(STEPS):
        started = time.monotonic()
        await asyncio.to_thread(trainer.train_step, batch(trainer.step + 1))
        current["step"] = trainer.step
        await dispatcher.after_step(trainer.step)
        step_seconds.append(time.monotonic() - started)
    await dispatcher.drain()
    return dispatcher, step_seconds


def metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def snapshots_on(volume: Path) -> list[str]:
    root = volume / "eval"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


async def test_skip_policy_counts_busy_points_and_evaluates_the_final_step(trainer, tmp_path):
    ev = evaluator("SlowWeightNormEval", delay_s=3.0)
    before = metric("rlfleet_eval_skipped_total", run="it-skip", reason="busy")
    dispatcher, _ = await run_training(trainer, ev, tmp_path, policy="skip", run="it-skip")
    final = trainer.step
    reasons = {p.step: p.skipped for p in dispatcher.points}
    busy = [s for s, r in reasons.items() if r == "busy"]
    assert busy, reasons
    assert reasons[final] is None and dispatcher.points[-1].step == final
    assert metric("rlfleet_eval_skipped_total", run="it-skip", reason="busy") - before == len(busy)
    # Every evaluated point saw its own step's snapshot, with the pinned version "<step>".
    seen = {Path(d).name: v for d, v in ev.fn.seen}
    assert seen == {f"step_{s}": str(s) for s, r in reasons.items() if r is None}
    assert snapshots_on(tmp_path) == sorted(f"step_{s}" for s, r in reasons.items() if r is None)[-2:]


async def test_backpressure_makes_training_wait_and_skips_nothing(trainer, tmp_path):
    ev = evaluator("SlowWeightNormEval", delay_s=3.0)
    dispatcher, step_seconds = await run_training(trainer, ev, tmp_path, policy="backpressure", run="it-bp")
    assert [p.skipped for p in dispatcher.points] == [None] * STEPS
    assert [p.step for p in dispatcher.points] == list(range(trainer.step - STEPS + 1, trainer.step + 1))
    assert dispatcher.backpressure_wait_s > 2 * 3.0  # the loop waited for the slow evaluator
    assert max(step_seconds) > 2.0
    scores = [p.scores["weights"] for p in dispatcher.points]
    assert len(set(scores)) == STEPS  # each point scored its own weights
    kept = snapshots_on(tmp_path)
    assert kept == sorted(f"step_{p.step}" for p in dispatcher.points[-2:])
    for name in kept:
        validate_snapshot(tmp_path / "eval" / name)  # sealed (.complete last) and intact


async def test_a_crashing_evaluator_skips_crashed_retires_each_snapshot_and_keeps_exactly_keep(trainer, tmp_path):
    first = trainer.step + 1
    ev = evaluator("CrashingEval", skip_steps=(first + 2,))
    before = metric("rlfleet_eval_skipped_total", run="it-crash", reason="crashed")
    dispatcher, _ = await run_training(trainer, ev, tmp_path, policy="backpressure", max_in_flight=2, keep=3,
                                       run="it-crash")
    reasons = [p.skipped for p in sorted(dispatcher.points, key=lambda p: p.step)]
    assert reasons == ["crashed", "crashed", "judge_down", "crashed", "crashed", "crashed"]
    assert metric("rlfleet_eval_skipped_total", run="it-crash", reason="crashed") - before == 5
    assert all("evaluator bug" in p.detail for p in dispatcher.points if p.skipped == "crashed")
    assert ev.fn.calls == STEPS
    assert dispatcher.ledger.balanced and dispatcher.ledger.retired == STEPS
    assert len(snapshots_on(tmp_path)) == 3
    assert metric("rlfleet_eval_snapshots", run="it-crash") == 3
    assert metric("rlfleet_eval_snapshot_bytes", run="it-crash") > 0


async def test_a_missing_class_or_a_wrong_base_class_is_a_clear_error():
    from rlfleet.orchestrator.evaluation.api import EvaluatorLoadError

    with pytest.raises(EvaluatorLoadError, match="cannot import"):
        load_checkpoint_eval_fn("no_such_module:Eval")
    with pytest.raises(EvaluatorLoadError, match="not a CheckpointEvalFn"):
        load_checkpoint_eval_fn("eval_user_classes:weight_score", search_dirs=[HERE])
    with pytest.raises(EvaluatorLoadError, match="unexpected keyword"):
        load_checkpoint_eval_fn("eval_user_classes:SlowWeightNormEval", {"delay": 1}, search_dirs=[HERE])


@pytest.mark.parametrize("eval_yaml, message", [
    ("eval:\n    posture: external\n    external:\n      classPath: no_such_evaluator:Eval\n",
     "classPath cannot import module 'no_such_evaluator'"),
    ("eval:\n    posture: fleet\n    fleet: {replicas: 1}\n    datasets:\n      - {name: mine, path: missing.jsonl}\n",
     "missing.jsonl"),
])
def test_rlfleet_run_rejects_an_unusable_eval_spec_before_starting_any_engine(tmp_path, capsys, eval_yaml, message):
    from rlfleet.orchestrator.run.cli import main

    manifest = (HERE.parents[1] / "examples" / "quickstart.yaml").read_text()
    head, _, _ = manifest.partition("  eval:\n")
    path = tmp_path / "run.yaml"
    path.write_text(head + "  " + eval_yaml.replace("\n", "\n  ").rstrip() + "\n  metricsPort: 9400\n")
    code = main([str(path), "--run-dir", str(tmp_path / "run"), "--metrics-port", "0"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "FAILED (EvalInvalid)" in err and message in err, err
    assert not (tmp_path / "run" / "engines").exists()  # no rollout engine was started
