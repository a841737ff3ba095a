"""A run survives its trainer: `rlfleet run` SIGKILLed at step 7, then `rlfleet run --resume`.

Real SGLang CPU engines, the real sglang-router, the real torch trainer. The killed run must leave no
process behind; the resumed one starts from the step-6 checkpoint, its engines serve the checkpoint's
weights, every step appears once, and its loss equals what a trainer that never stopped computes on
the same batches (replayed here from the batches both runs recorded).
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from helpers.cli_run import start_cli_run, wait_output, write_manifest

pytestmark = pytest.mark.engines

STEPS = 12
LEAN = {  # a small, quick run: one engine, 8 groups of 8 a step
    "trainer": {"promptsPerStep": 8, "samplesPerPrompt": 8},
    "checkpoint": {"intervalSteps": 3, "keep": 2},
}


def alive(groups: set[int]) -> set[int]:
    left = set()
    for group in groups:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            pass
        left.add(group)
    return left


def replay(manifest: Path, batches: list[Path]) -> tuple[list[tuple[float, float]], list[dict]]:
    """A trainer built as the run builds it, trained on the recorded batches in order: each step's
    (loss, gradient norm), and its weights after each step."""
    from rlfleet.crds.loader import load_training_run
    from rlfleet.orchestrator.run.loop import resolve_model_dir
    from rlfleet.trainer import grpo
    from rlfleet.trainer.base import build_trainer

    t = load_training_run(manifest).spec.trainer
    trainer = build_trainer(t.backend, resolve_model_dir(load_training_run(manifest).spec.model_path),
                            t.learning_rate, seed=t.seed, device="cpu", max_grad_norm=t.grad_clip,
                            micro_batch_size=t.micro_batch_size,
                            loss=grpo.LossConfig(clip_low=t.eps_clip, clip_high=t.eps_clip,
                                                 temperature=t.temperature or 1.0, kl_coef=t.kl_coef))
    losses, weights = [], []
    for path in batches:
        samples = [grpo.Sample(**{**s, "prompt_ids": tuple(s["prompt_ids"]), "response_ids": tuple(s["response_ids"]),
                                  "sampling_logprobs": tuple(s["sampling_logprobs"])})
                   for s in json.loads(path.read_text())["samples"]]
        stats = trainer.train_step(samples)
        losses.append((stats["loss"], stats["grad_norm"]))
        model, _ = trainer.checkpoint_objects()
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return losses, weights


def test_sigkilled_run_leaves_nothing_and_resumes_each_step_once(tmp_path: Path):
    from rlfleet.util.procs import groups_writing_under

    volume = tmp_path / "volume"
    manifest = write_manifest(tmp_path / "run.yaml", steps=STEPS, replicas=1,
                              spec={**LEAN, "weightSync": {"snapshotVolume": {"localPath": str(volume)}}})
    first, run_dir, out = start_cli_run(tmp_path, manifest=manifest, tag="first",
                                        args=("--record-batches", str(tmp_path / "batches-first")))
    try:
        wait_output(first, out, "checkpoint step 6 written")
        groups = groups_writing_under(run_dir)
        assert len(groups) >= 2, groups  # the engine and the router
        first.send_signal(signal.SIGKILL)
        assert first.wait(timeout=30) == -signal.SIGKILL
        killed_at = time.monotonic()
        while (alive(groups) or groups_writing_under(run_dir)) and time.monotonic() - killed_at < 10:
            time.sleep(0.2)
        left = alive(groups) | groups_writing_under(run_dir)
    finally:
        if first.poll() is None:
            first.kill()
    assert not left, f"process groups {left} outlived the SIGKILLed run by 10 s"
    first_steps = sorted(int(p.stem.removeprefix("step_")) for p in (tmp_path / "batches-first").glob("step_*.json"))
    assert first_steps[:6] == [1, 2, 3, 4, 5, 6], first_steps

    summary = tmp_path / "summary.json"
    resumed, _, resumed_out = start_cli_run(tmp_path, manifest=manifest, tag="resumed",
                                            args=("--resume", "--summary", str(summary),
                                                  "--record-batches", str(tmp_path / "batches-resumed")))
    try:
        rc = resumed.wait(timeout=900)
    finally:
        if resumed.poll() is None:
            resumed.kill()
    output = resumed_out.read_text()
    assert rc == 0, output[-3000:]
    assert "resuming from checkpoint step 6" in output, output[-3000:]
    data = json.loads(summary.read_text())
    assert data["steps_completed"] == data["steps_planned"] == STEPS, data
    assert list(data["weight_versions_per_step"]) == [str(n) for n in range(1, STEPS + 1)], data
    assert data["resumed_from"] == [6]
    # The engines were brought to the checkpoint's weights before any rollout was used: step 7 trains
    # only on samples of version 6 (the checkpoint), never on the launch weights or anything newer.
    assert data["weight_versions_per_step"]["7"] == ["6"], data["weight_versions_per_step"]
    assert data["engine_versions_per_step"]["12"] == {"0": "12"}
    assert [c["step"] for c in data["checkpoints"]] == [3, 6, 9, 12], data["checkpoints"]
    assert len(data["reward_mean_per_step"]) == STEPS  # the reward goes on where it stopped
    resumed_steps = sorted(int(p.stem.removeprefix("step_")) for p in (tmp_path / "batches-resumed").glob("*.json"))
    assert resumed_steps == list(range(7, STEPS + 1)), resumed_steps

    # A trainer that never stopped, on both runs' recorded batches (1..6 first, 7..12 resumed): every
    # step's loss and gradient norm, and its weights after step 12 against the resumed run's step-12
    # checkpoint. An on-policy step's clipped loss is ~0 whatever the weights, and a step whose groups
    # all scored alike has no gradient at all, so the weights carry the check: Adam's restored moments
    # keep moving them after step 6 even then (asserted, so the comparison can tell runs apart).
    from rlfleet.trainer import checkpoint as ckpt

    batches = [tmp_path / "batches-first" / f"step_{n}.json" for n in range(1, 7)]
    batches += [tmp_path / "batches-resumed" / f"step_{n}.json" for n in range(7, STEPS + 1)]
    replayed, weights = replay(manifest, batches)
    recorded = [(d["loss"], d["stats"]["grad_norm"]) for d in (json.loads(p.read_text()) for p in batches)]
    for (loss, norm), (want_loss, want_norm) in zip(recorded, replayed, strict=True):
        assert loss == pytest.approx(want_loss, abs=1e-5) and norm == pytest.approx(want_norm, rel=1e-4, abs=1e-5), (
            recorded, replayed)
    moved = max(float((weights[-1][k] - weights[5][k]).abs().max()) for k in weights[-1])
    assert moved > 1e-5, "the resumed steps did not change the weights: nothing to compare"
    info = ckpt.validate(ckpt.step_dir(volume / "checkpoints", STEPS))
    resumed_weights = ckpt.load_shard(info)["model"]
    assert set(resumed_weights) == set(weights[-1])
    worst = max(float((resumed_weights[k].float() - weights[-1][k].float()).abs().max()) for k in resumed_weights)
    assert worst <= 1e-5, f"the resumed run's step-{STEPS} weights differ from a never-stopped trainer's by {worst}"
    assert [float(data["loss_per_step"][str(n)]) for n in range(7, STEPS + 1)] == pytest.approx(
        [r[0] for r in recorded[6:]], abs=1e-6)
    print(f"\nfigures: resumed from step 6; step 7 loss {recorded[6][0]:.6f} grad norm {recorded[6][1]:.6f} "
          f"(never stopped: {replayed[6][0]:.6f}, {replayed[6][1]:.6f}); step-{STEPS} weights within {worst:.2e} "
          f"of a never-stopped trainer's (moved {moved:.2e} since step 6); checkpoints {data['checkpoints']}")
