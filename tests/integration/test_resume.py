"""A run survives its trainer: `rlfleet run` SIGKILLed after its step-4 checkpoint, then `rlfleet run --resume`.

Real SGLang CPU engines, the real sglang-router, the real trainer: megatron-core tensor parallel 2 in two
real ranks (each writes its own shard). The killed run must leave no process behind (ranks included);
the resumed one starts from the step-4 checkpoint, its engines serve the checkpoint's weights, every
step appears once, and its loss equals what a trainer of the same layout that never stopped computes on
the same batches (replayed here, trainer only, from the batches both runs recorded). A single-rank torch
trainer's resume is covered on the cluster (tests/e2e/test_operator.py: its trainer pod is deleted and
the recreated one resumes); the rank-file checkpoint format is the same for both backends.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from helpers.cli_run import children_of, failure_excerpt, held, start_cli_run, wait_output, write_manifest

pytestmark = pytest.mark.engines

STEPS = 8
KILLED_AFTER = 4  # the checkpoint the resumed run starts from
LEAN = {  # a small, quick run: one engine, 8 groups of 8 a step
    "trainer": {"promptsPerStep": 8, "samplesPerPrompt": 8},
    "checkpoint": {"intervalSteps": 2, "keep": 2},
}
# megatron-core tensor parallel 2 (two real ranks, gloo): each rank writes its own shard, the
# launcher's SIGKILL takes the ranks with it.
TRAINERS = {"megatron-tp2": {"backend": "megatron", "tensorParallelSize": 2}}


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

    args = (str(manifest), [str(b) for b in batches], str(checkpoint_dir), KILLED_AFTER)
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
        wait_output(first, out, f"checkpoint step {KILLED_AFTER} written")
        # Held at once, with the ranks it launched (its children; their engines run on): the look for its
        # processes below takes a while, in which a fast run could write the next checkpoint (the resume
        # would then start from it). Killed while held; the ranks, let go, die with it (SIGKILL).
        with held(first.pid, *(children_of(first.pid) if world > 1 else ())):
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
    assert first_steps[:KILLED_AFTER] == list(range(1, KILLED_AFTER + 1)), first_steps

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
    assert rc == 0, failure_excerpt(output)
    assert f"resuming from checkpoint step {KILLED_AFTER}" in output, failure_excerpt(output)
    data = json.loads(summary.read_text())
    assert data["steps_completed"] == data["steps_planned"] == STEPS, data
    assert list(data["weight_versions_per_step"]) == [str(n) for n in range(1, STEPS + 1)], data
    assert data["resumed_from"] == [KILLED_AFTER]
    from rlfleet.trainer import checkpoint as ckpt

    # The engines were brought to the checkpoint's weights before any rollout was used: the first resumed
    # step trains only on samples of the checkpoint's version, never on the launch weights or anything newer.
    first_resumed = KILLED_AFTER + 1
    assert data["weight_versions_per_step"][str(first_resumed)] == [str(KILLED_AFTER)], data["weight_versions_per_step"]
    assert data["engine_versions_per_step"][str(STEPS)] == {"0": str(STEPS)}
    assert [c["step"] for c in data["checkpoints"]] == list(range(2, STEPS + 1, 2)), data["checkpoints"]
    assert len(data["reward_mean_per_step"]) == STEPS  # the reward goes on where it stopped
    resumed_steps = sorted(int(p.stem.removeprefix("step_")) for p in (tmp_path / "batches-resumed").glob("*.json"))
    assert resumed_steps == list(range(first_resumed, STEPS + 1)), resumed_steps

    info = ckpt.validate(ckpt.step_dir(volume / "checkpoints", STEPS))
    assert info.meta["shards"] == [ckpt.shard_name(r) for r in range(world)], info.meta

    # A trainer that never stopped, on both runs' recorded batches (the first run's up to the checkpoint,
    # the resumed run's after it): every step's loss and gradient norm, and its weights after the last
    # step against the resumed run's last checkpoint (every rank's shard). An on-policy step's clipped
    # loss is ~0 whatever the weights, and a step whose groups all scored alike has no gradient at all,
    # so the weights carry the check: Adam's restored moments keep moving them after the checkpoint even
    # then (asserted, so the comparison can tell runs apart).
    batches = [tmp_path / "batches-first" / f"step_{n}.json" for n in range(1, first_resumed)]
    batches += [tmp_path / "batches-resumed" / f"step_{n}.json" for n in range(first_resumed, STEPS + 1)]
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
    assert [float(data["loss_per_step"][str(n)]) for n in range(first_resumed, STEPS + 1)] == pytest.approx(
        [r[0] for r in recorded[KILLED_AFTER:]], abs=1e-6)
    loss, norm = recorded[KILLED_AFTER]
    want_loss, want_norm = replayed["steps"][KILLED_AFTER]
    print(f"\nfigures ({trainer}, {world} rank(s)): resumed from step {KILLED_AFTER}; step {first_resumed} loss "
          f"{loss:.6f} grad norm {norm:.6f} (never stopped: {want_loss:.6f}, {want_norm:.6f}); "
          f"step-{STEPS} weights within {worst:.2e} of a never-stopped trainer's (moved {replayed['moved']:.2e} "
          f"since step {KILLED_AFTER}); checkpoints {data['checkpoints']}; test {time.monotonic() - started:.0f} s "
          f"(replay {replay_s:.0f} s)")
