"""A run survives its trainer: `rlfleet run` SIGKILLed at step 7, then `rlfleet run --resume`.

Real SGLang CPU engines, the real sglang-router, the real trainer: torch on one rank, and megatron-core
tensor parallel 2 in two real ranks (each writes its own shard). The killed run must leave no process
behind (ranks included); the resumed one starts from the step-6 checkpoint, its engines serve the
checkpoint's weights, every step appears once, and its loss equals what a trainer of the same layout
that never stopped computes on the same batches (replayed here, trainer only, from the batches both
runs recorded).
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
# The torch trainer on one rank; megatron-core tensor parallel 2 (two real ranks, gloo): each rank
# writes its own shard, the launcher's SIGKILL takes the ranks with it.
TRAINERS = {"torch": {}, "megatron-tp2": {"backend": "megatron", "tensorParallelSize": 2}}


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


def writers(run_dir: Path) -> dict[int, str]:
    """pid -> command line of every live process whose output goes to a file under run_dir."""
    prefix = str(run_dir.resolve()) + "/"
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/fd/1").startswith(prefix):
                found[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        except OSError:
            continue
    return found


def replay(manifest: Path, batches: list[Path], checkpoint_dir: Path, world: int) -> dict:
    """A never-stopped trainer of the run's layout on the recorded batches (helpers/rank_steps.py):
    in this process for one rank, in `world` real ranks (gloo) from the launcher for more."""
    from helpers.rank_steps import replay_run

    args = (str(manifest), [str(b) for b in batches], str(checkpoint_dir), 6)
    if world == 1:
        result = replay_run(*args)
    else:
        from rlfleet.trainer.launch import launch_ranks

        result = launch_ranks(replay_run, args, world=world, log_dir=checkpoint_dir.parents[1] / "replay-ranks")[0]
    assert result is not None
    return result


@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_sigkilled_run_leaves_nothing_and_resumes_each_step_once(tmp_path: Path, trainer: str):
    from rlfleet.util.procs import groups_writing_under

    started = time.monotonic()
    volume = tmp_path / "volume"
    spec = {**LEAN, "trainer": {**LEAN["trainer"], **TRAINERS[trainer]},
            "weightSync": {"snapshotVolume": {"localPath": str(volume)}}}
    manifest = write_manifest(tmp_path / "run.yaml", steps=STEPS, replicas=1, spec=spec)
    world = 2 if trainer == "megatron-tp2" else 1
    first, run_dir, out = start_cli_run(tmp_path, manifest=manifest, tag="first",
                                        args=("--record-batches", str(tmp_path / "batches-first")))
    try:
        wait_output(first, out, "checkpoint step 6 written")
        # The engine's and the router's groups; the ranks run in the launcher's (this test's) group, so
        # they are found by the files they write under the run directory.
        groups = groups_writing_under(run_dir) - {os.getpgrp()}
        assert len(groups) >= 2, groups
        if world > 1:
            assert len(writers(run_dir)) >= 2 + world, writers(run_dir)
        first.send_signal(signal.SIGKILL)
        assert first.wait(timeout=30) == -signal.SIGKILL
        killed_at = time.monotonic()
        while (alive(groups) or groups_writing_under(run_dir)) and time.monotonic() - killed_at < 10:
            time.sleep(0.2)
        left = alive(groups) | groups_writing_under(run_dir)
    finally:
        if first.poll() is None:
            first.kill()
    assert not left, f"process groups {left} outlived the SIGKILLed run by 10 s: {writers(run_dir)}"
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
    from rlfleet.trainer import checkpoint as ckpt

    # The engines were brought to the checkpoint's weights before any rollout was used: step 7 trains
    # only on samples of version 6 (the checkpoint), never on the launch weights or anything newer.
    assert data["weight_versions_per_step"]["7"] == ["6"], data["weight_versions_per_step"]
    assert data["engine_versions_per_step"]["12"] == {"0": "12"}
    assert [c["step"] for c in data["checkpoints"]] == [3, 6, 9, 12], data["checkpoints"]
    assert len(data["reward_mean_per_step"]) == STEPS  # the reward goes on where it stopped
    resumed_steps = sorted(int(p.stem.removeprefix("step_")) for p in (tmp_path / "batches-resumed").glob("*.json"))
    assert resumed_steps == list(range(7, STEPS + 1)), resumed_steps

    info = ckpt.validate(ckpt.step_dir(volume / "checkpoints", STEPS))
    assert info.meta["shards"] == [ckpt.shard_name(r) for r in range(world)], info.meta

    # A trainer that never stopped, on both runs' recorded batches (1..6 first, 7..12 resumed): every
    # step's loss and gradient norm, and its weights after step 12 against the resumed run's step-12
    # checkpoint (every rank's shard). An on-policy step's clipped loss is ~0 whatever the weights, and
    # a step whose groups all scored alike has no gradient at all, so the weights carry the check:
    # Adam's restored moments keep moving them after step 6 even then (asserted, so the comparison
    # can tell runs apart).
    batches = [tmp_path / "batches-first" / f"step_{n}.json" for n in range(1, 7)]
    batches += [tmp_path / "batches-resumed" / f"step_{n}.json" for n in range(7, STEPS + 1)]
    replay_started = time.monotonic()
    replayed = replay(manifest, batches, info.directory, world)
    replay_s = time.monotonic() - replay_started
    recorded = [(d["loss"], d["stats"]["grad_norm"]) for d in (json.loads(p.read_text()) for p in batches)]
    for (loss, norm), (want_loss, want_norm) in zip(recorded, replayed["steps"], strict=True):
        assert loss == pytest.approx(want_loss, abs=1e-5) and norm == pytest.approx(want_norm, rel=1e-4, abs=1e-5), (
            recorded, replayed["steps"])
    assert replayed["moved"] > 1e-5, "the resumed steps did not change the weights: nothing to compare"
    worst = replayed["worst"]
    assert worst <= 1e-5, f"the resumed run's step-{STEPS} weights differ from a never-stopped trainer's by {worst}"
    assert [float(data["loss_per_step"][str(n)]) for n in range(7, STEPS + 1)] == pytest.approx(
        [r[0] for r in recorded[6:]], abs=1e-6)
    print(f"\nfigures ({trainer}, {world} rank(s)): resumed from step 6; step 7 loss {recorded[6][0]:.6f} grad norm "
          f"{recorded[6][1]:.6f} (never stopped: {replayed['steps'][6][0]:.6f}, {replayed['steps'][6][1]:.6f}); "
          f"step-{STEPS} weights within {worst:.2e} of a never-stopped trainer's (moved {replayed['moved']:.2e} "
          f"since step 6); checkpoints {data['checkpoints']}; test {time.monotonic() - started:.0f} s "
          f"(replay {replay_s:.0f} s)")
