"""A stop is bounded: SIGTERM, SIGHUP or Ctrl-C ends `rlfleet run` even when its cleanup hangs, and so
does a failure, whether its cleanup hangs or a thread the loop's shutdown waits for never ends."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# A "run" whose cleanup never finishes: it swallows its cancellation and then waits on something
# that cannot finish (what a stop path must never be able to do to the process).
STUBBORN = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from rlfleet.orchestrator.run import cli

    async def stubborn():
        print("running", flush=True)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            print("cleaning up", flush=True)
            await asyncio.Event().wait()

    def force_stop():
        Path(sys.argv[1]).write_text("forced")

    async def main():
        return await cli._until_signal(stubborn, force_stop=force_stop, stop_bound_s=1.0)

    sys.exit(cli._finish(main))
""")

GRACEFUL = textwrap.dedent("""
    import asyncio, sys
    from rlfleet.orchestrator.run import cli

    async def run():
        print("running", flush=True)
        await asyncio.Event().wait()

    sys.exit(cli._finish(run, force_stop=lambda: None))
""")

# A run that fails: the loop tells the bound as its cleanup starts (RunStack), and the cleanup hangs.
FAILING_CLEANUP = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from rlfleet.orchestrator.run import cli
    from rlfleet.orchestrator.run.loop import RunFailed, RunStack

    def force_stop():
        Path(sys.argv[1]).write_text("forced")

    bound = cli.StopBound(30.0, failed_s=1.0, force_stop=force_stop)  # a signal's bound is not the one

    async def record(error):  # what a pod does: the failure written on the run, before the cleanup
        Path(sys.argv[1]).with_name("recorded").write_text(f"{error.reason}: {error.message}")

    async def failing():
        print("running", flush=True)
        async with RunStack(bound.failed, record) as stack:
            stack.push_async_callback(asyncio.Event().wait)  # a cleanup that never finishes
            raise RunFailed("TrainerRankFailed", "rank 0 failed on purpose")

    sys.exit(cli._finish(failing, bound=bound))
""")

# A run that fails while a thread it started (a trainer call, say) never returns: the loop's shutdown
# waits for it.
FAILING_THREAD = textwrap.dedent("""
    import asyncio, sys, threading
    from rlfleet.orchestrator.run import cli

    async def failing():
        print("running", flush=True)
        asyncio.ensure_future(asyncio.to_thread(threading.Event().wait))
        await asyncio.sleep(0.1)
        raise ValueError("a step failed on purpose")

    sys.exit(cli._finish(failing, bound=cli.StopBound(30.0, failed_s=1.0)))
""")


def start(tmp_path: Path, script: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-P", "-c", script, str(tmp_path / "forced")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "running"
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_hanging_cleanup_is_cut_off_at_the_bound(tmp_path: Path, sig: int):
    proc = start(tmp_path, STUBBORN)
    sent = time.monotonic()
    proc.send_signal(sig)
    rc = proc.wait(timeout=30)
    took = time.monotonic() - sent
    output = proc.stdout.read()
    assert rc == 128 + sig, output
    assert "stop took longer than 1 s" in output
    assert (tmp_path / "forced").read_text() == "forced"  # what was left of the run was killed
    # What held the stop up is named: the run's task, waiting in the stubborn cleanup.
    assert "still running at the bound:" in output and "stubborn (<string>:" in output, output
    assert took < 10, took


@pytest.mark.parametrize("sig, says", [(signal.SIGTERM, "stopped by SIGTERM"), (signal.SIGINT, "interrupted")])
def test_a_clean_stop_exits_with_the_signal_and_forces_nothing(tmp_path: Path, sig: int, says: str):
    proc = start(tmp_path, GRACEFUL)
    proc.send_signal(sig)
    rc = proc.wait(timeout=30)
    output = proc.stdout.read()
    assert rc == 128 + sig and says in output, output
    assert "stop took longer" not in output


@pytest.mark.parametrize("script, says, forced", [
    (FAILING_CLEANUP, "FAILED (TrainerRankFailed): rank 0 failed on purpose", True),
    (FAILING_THREAD, "FAILED: ValueError: a step failed on purpose", False),  # nothing to kill: no force_stop
], ids=["cleanup-hangs", "thread-never-returns"])
def test_a_failed_run_whose_stop_hangs_exits_failed_at_its_bound(tmp_path: Path, script: str, says: str,
                                                                  forced: bool):
    proc = start(tmp_path, script)
    started = time.monotonic()
    rc = proc.wait(timeout=30)
    took = time.monotonic() - started
    output = proc.stdout.read()
    assert rc == 1, output
    assert says in output and "stop took longer than 1 s" in output, output  # the failure is said first
    assert took < 10, took
    assert (tmp_path / "forced").exists() == forced
    if forced:  # the failure was told before the cleanup that the bound cut short
        assert (tmp_path / "recorded").read_text() == "TrainerRankFailed: rank 0 failed on purpose"


async def test_the_run_stack_tells_of_a_run_error_before_its_cleanup_and_cleans_up_whatever_that_did():
    import asyncio

    from rlfleet.errors import RunError
    from rlfleet.orchestrator.run.loop import RunStack

    order: list[str] = []

    async def told(error: RunError) -> None:
        order.append(f"told {error.reason}")

    async def cleanup() -> None:
        order.append("cleaned up")

    async def group_failing() -> None:  # raised inside a task group, as a run's guards raise
        async with asyncio.TaskGroup() as group:
            group.create_task(asyncio.sleep(3600))
            raise RunError("the watchdog tripped", reason="RolloutEnginesUnavailable")

    with pytest.raises(ExceptionGroup):
        async with RunStack(failing=told) as stack:
            stack.push_async_callback(cleanup)
            await group_failing()
    assert order == ["told RolloutEnginesUnavailable", "cleaned up"]

    order.clear()
    with pytest.raises(ValueError):  # not a RunError (a bug): nothing to tell, cleaned up
        async with RunStack(failing=told) as stack:
            stack.push_async_callback(cleanup)
            raise ValueError("a bug")
    assert order == ["cleaned up"]

    async def cannot_tell(error: RunError) -> None:
        raise OSError("the API server is gone")

    order.clear()
    with pytest.raises(RunError, match="rank 1 failed"):  # the run's own error, not the teller's
        async with RunStack(failing=cannot_tell) as stack:
            stack.push_async_callback(cleanup)
            raise RunError("rank 1 failed", reason="TrainerRankFailed")
    assert order == ["cleaned up"]

    async def hangs(error: RunError) -> None:
        await asyncio.Event().wait()

    async def fails_then_hangs() -> None:
        async with RunStack(failing=hangs) as stack:
            stack.push_async_callback(cleanup)
            raise RunError("rank 1 failed", reason="TrainerRankFailed")

    order.clear()
    task = asyncio.create_task(fails_then_hangs())
    await asyncio.sleep(0.05)
    task.cancel()  # a stop while the failure is being told: the cleanup still runs, the cancel goes on
    with pytest.raises(asyncio.CancelledError):
        await task
    assert order == ["cleaned up"]
