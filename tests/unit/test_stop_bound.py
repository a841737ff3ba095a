"""A stop is bounded: SIGTERM, SIGHUP or Ctrl-C ends `rlfleet run` even when its cleanup hangs."""
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
