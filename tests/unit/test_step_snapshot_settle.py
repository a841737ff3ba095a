"""A broadcast step's snapshot, written beside the next step: when it becomes what replacements start
from, what waits for it, and a write that fails (the run loop's bookkeeping, no engines)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rlfleet.crds.loader import load_training_run
from rlfleet.orchestrator.run.loop import PendingSnapshot, RunFailed, RunLoop, RunOptions

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"


def run_loop(tmp_path: Path, keep: int) -> RunLoop:
    run = load_training_run(QUICKSTART)
    run.spec.weight_sync.keep_snapshots = keep
    loop = RunLoop(run, RunOptions(run_dir=tmp_path / "run"), snapshots=tmp_path / "snapshots")
    for step in range(3):
        (tmp_path / "snapshots" / f"step_{step}").mkdir(parents=True)
    loop.launch_snapshot = loop.current_snapshot = tmp_path / "snapshots" / "step_0"
    return loop


async def test_a_snapshot_still_being_written_is_not_current_until_it_is(tmp_path: Path):
    loop = run_loop(tmp_path, keep=1)
    step_1, step_2 = tmp_path / "snapshots" / "step_1", tmp_path / "snapshots" / "step_2"
    written = asyncio.get_running_loop().create_future()
    loop._pending_snapshot = PendingSnapshot(1, step_1, written)
    assert await loop._settle_snapshot(wait=False) is None  # still being written: nothing moves
    assert loop.current_snapshot == tmp_path / "snapshots" / "step_0"

    asyncio.get_running_loop().call_later(0.05, written.set_result, step_1)
    waited = await loop._settle_snapshot(wait=True)  # what the next step's export does
    assert waited is not None and waited >= 0.04
    assert loop.current_snapshot == step_1

    loop._pending_snapshot = PendingSnapshot(2, step_2, written)  # written already
    assert await loop._settle_snapshot(wait=False) == pytest.approx(0.0, abs=0.01)
    assert loop.current_snapshot == step_2
    assert not step_1.exists()  # keepSnapshots 1: retired once step 2 was written, not before
    assert (tmp_path / "snapshots" / "step_0").exists()  # the launch weights stay
    assert await loop._settle_snapshot(wait=True) is None  # nothing pending


async def test_a_snapshot_that_cannot_be_written_fails_the_run_naming_it(tmp_path: Path):
    loop = run_loop(tmp_path, keep=2)
    step_1 = tmp_path / "snapshots" / "step_1"
    written = asyncio.get_running_loop().create_future()
    written.set_exception(OSError(28, "No space left on device"))
    loop._pending_snapshot = PendingSnapshot(1, step_1, written)
    with pytest.raises(RunFailed, match=r"SnapshotWriteFailed: .*step 1 .*No space left on device") as caught:
        await loop._settle_snapshot(wait=True)
    assert caught.value.reason == "SnapshotWriteFailed"
    # Whoever settles it first (the watchdog's recovery, say), the loop fails on it too.
    with pytest.raises(RunFailed, match="SnapshotWriteFailed"):
        await loop._settle_snapshot(wait=True)
    assert loop.current_snapshot == tmp_path / "snapshots" / "step_0"  # replacements keep the last good one
    assert step_1.exists()  # nothing retired for a snapshot that was not written


async def test_a_cancelled_waiter_leaves_the_snapshot_to_the_next_one(tmp_path: Path):
    loop = run_loop(tmp_path, keep=2)
    step_1 = tmp_path / "snapshots" / "step_1"
    written = asyncio.get_running_loop().create_future()
    loop._pending_snapshot = PendingSnapshot(1, step_1, written)
    waiter = asyncio.ensure_future(loop._settle_snapshot(wait=True))  # e.g. the watchdog's recovery
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not written.cancelled()  # the write itself goes on
    written.set_result(step_1)
    assert await loop._settle_snapshot(wait=True) is not None
    assert loop.current_snapshot == step_1
