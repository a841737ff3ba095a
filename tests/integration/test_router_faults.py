"""`rlfleet run` when the router dies: real SGLang CPU engines, the real sglang-router, the real trainer.

Killed routers (the rollout fleet's and the eval fleet's, in one run shared by two tests) are restarted
and the run goes on; a router that may not come back fails the run with
its reason; a run whose router is dead (or hung) still stops on SIGTERM and Ctrl-C within the stated
bound, leaving no engine, router or scratch volume.
"""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import pytest_asyncio

from helpers.cli_run import failure_excerpt, start_cli_run, wait_output
from rlfleet.orchestrator.run.local import LocalRun, RunFailed, RunOptions
from rlfleet.orchestrator.run.progress import ProgressReporter

pytestmark = pytest.mark.engines

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REFUSED_BOUND = 1000  # refused connections (attempts sent to the dead router) after one kill, in total
STOP_BOUND_S = 25.0  # rlfleet run's stop bound (20 s) plus the interpreter's exit


def quickstart(steps: int, *, replicas: int = 1, eval_on: bool = False):
    from rlfleet.crds.loader import load_training_run

    run = load_training_run(EXAMPLES / "quickstart.yaml")
    run.spec.trainer.steps = steps
    run.spec.rollout.replicas = replicas
    if not eval_on:
        run.spec.eval = None
    return run


async def wait_for(predicate, task: asyncio.Task, log: io.StringIO, timeout_s: float = 900) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            if task.done():
                raise AssertionError(f"run ended early: {task.exception()}\n{log.getvalue()[-3000:]}")
            await asyncio.sleep(0.05)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def two_router_kills(tmp_path_factory):
    """One run (a rollout engine, an eval engine, each fleet behind its own router) whose eval router is
    SIGKILLed while the point of step 0 is being pinned, and whose rollout router is SIGKILLed while step
    3 rolls out. Both routers must be restarted and the run must complete."""
    tmp_path = tmp_path_factory.mktemp("router-kills")
    run = quickstart(steps=4, eval_on=True)
    run.spec.eval.interval_steps = 2  # points at 0 (before training), 2 and 4
    log = io.StringIO()
    local = LocalRun(run, RunOptions(run_dir=tmp_path / "run", summary_path=tmp_path / "summary.json",
                                     metrics_port=0, progress=ProgressReporter(log, tty=False)))
    task = asyncio.create_task(local.execute())
    try:
        def point_in_flight() -> bool:
            evaluator = local.evaluation.evaluator if local.evaluation is not None else None
            return evaluator is not None and evaluator._lock.locked()

        await wait_for(point_in_flight, task, log)  # the point of step 0 is being pinned
        local.eval_router.process.signal_group(signal.SIGKILL)

        await wait_for(lambda: len(local.summary.steps) >= 2, task, log)  # step 3 is rolling out now
        old_url = local.fleet.router_url
        local.router.process.signal_group(signal.SIGKILL)
        killed_at = asyncio.get_running_loop().time()
        await wait_for(lambda: local.supervisors["rollout"].restored >= 1, task, log, timeout_s=120)
        restarted_s = asyncio.get_running_loop().time() - killed_at
        summary = await asyncio.wait_for(task, 1200)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    data = json.loads((tmp_path / "summary.json").read_text())
    return {"local": local, "summary": summary, "data": data, "log": log.getvalue(), "old_url": old_url,
            "restarted_s": restarted_s}


async def test_a_killed_rollout_router_is_restarted_and_the_run_completes(two_router_kills):
    local, summary, data, log = (two_router_kills[k] for k in ("local", "summary", "data", "log"))
    assert data["steps_completed"] == data["steps_planned"] == 4, log[-3000:]
    assert summary.failure is None
    assert data["router_restarts"] == {"rollout": 1, "eval": 1}, data["router_restarts"]
    assert any("router restarted" in e for e in data["router_events"]), data["router_events"]
    assert "router restarted" in log
    assert local.fleet.router_url == two_router_kills["old_url"]  # same address: nothing had to follow it
    refused = data["rollout_attempts"].get("connection_refused", 0)
    assert refused < REFUSED_BOUND, data["rollout_attempts"]
    print(f"\nfigures: router restarted {two_router_kills['restarted_s']:.1f} s after the kill; attempts "
          f"{data['rollout_attempts']}; refused connections {refused} (bound {REFUSED_BOUND})")


async def test_a_killed_eval_router_skips_the_point_in_flight_and_the_next_point_scores(two_router_kills):
    summary, data, log = (two_router_kills[k] for k in ("summary", "data", "log"))
    assert summary.failure is None and data["steps_completed"] == 4, log[-3000:]
    assert data["router_restarts"].get("eval") == 1, data
    points = {p["step"]: p for p in data["eval"]}
    assert points[0]["skipped"] == "unhealthy", points[0]
    assert "router restarted" in (points[0].get("detail") or ""), points[0]
    scored = [p for p in data["eval"] if not p["skipped"]]
    assert scored and min(p["step"] for p in scored) == 2, data["eval"]
    assert all(p["weight_version"] == str(p["step"]) for p in scored), scored
    assert "fleet eval: router restarted" in log


async def test_a_router_that_may_not_come_back_fails_the_run_with_its_reason(tmp_path: Path):
    run = quickstart(steps=10)
    run.spec.rollout.router.max_restarts = 0
    spec = run.spec.watchdog
    log = io.StringIO()
    local = LocalRun(run, RunOptions(run_dir=tmp_path / "run", metrics_port=0,
                                     progress=ProgressReporter(log, tty=False)))
    task = asyncio.create_task(local.execute())
    await wait_for(lambda: len(local.summary.steps) >= 1, task, log)
    local.router.process.signal_group(signal.SIGKILL)
    killed_at = asyncio.get_running_loop().time()
    with pytest.raises(RunFailed) as info:
        await asyncio.wait_for(task, spec.checks * spec.check_interval_seconds + spec.window_seconds)
    failed_s = asyncio.get_running_loop().time() - killed_at
    assert info.value.reason == "RouterUnavailable"
    assert "maxRestarts 0" in info.value.message and "router last log lines" in info.value.message
    assert local.summary.failure.startswith("RouterUnavailable")
    print(f"\nfigures: run failed {failed_s:.1f} s after the router kill (bound "
          f"{spec.checks * spec.check_interval_seconds + spec.window_seconds} s)")


# --- stopping with a dead or hung serving path (the CLI, as users run it) ------------------------------

def group_logging_to(log_path: Path) -> int | None:
    """The process group of the live process whose stdout is `log_path`."""
    target = str(log_path.resolve())
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/fd/1") == target:
                    return os.getpgid(int(entry))
    return None


def stop_and_check(proc: subprocess.Popen, run_dir: Path, out: Path, sig: int) -> float:
    from rlfleet.snapshot.volume import default_local_volume, is_scratch_volume
    from rlfleet.util.procs import groups_writing_under

    time.sleep(3)  # let the clients spin on the dead path
    stopped_at = time.monotonic()
    proc.send_signal(sig)
    rc = proc.wait(timeout=120)
    stop_s = time.monotonic() - stopped_at
    output = out.read_text()
    assert rc == 128 + sig, failure_excerpt(output)
    assert groups_writing_under(run_dir) == set()
    volume = default_local_volume(run_dir)
    if is_scratch_volume(volume):
        assert not volume.exists()
    assert stop_s < STOP_BOUND_S, f"stopped in {stop_s:.1f} s\n{failure_excerpt(output)}"
    return stop_s


def test_sigterm_stops_a_run_whose_router_is_dead(tmp_path: Path):
    """The router is killed twice: the second restart waits out a long backoff, so the path stays dead
    while every client retries."""
    proc, run_dir, out = start_cli_run(tmp_path,
                                       rollout={"recovery": {"backoffBaseSeconds": 120, "backoffMaxSeconds": 120}})
    try:
        wait_output(proc, out, "step 1/1000")
        router_log = run_dir / "router.log"
        os.killpg(group_logging_to(router_log), signal.SIGKILL)
        wait_output(proc, out, "router restarted", timeout_s=60)
        time.sleep(1)
        os.killpg(group_logging_to(router_log), signal.SIGKILL)
        wait_output(proc, out, "exited with code", timeout_s=30)
        stop_s = stop_and_check(proc, run_dir, out, signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "stopped by SIGTERM" in out.read_text()
    print(f"\nfigures: SIGTERM with the router dead -> exited, everything stopped, in {stop_s:.1f} s")


def test_ctrl_c_stops_a_run_whose_router_hangs(tmp_path: Path):
    """The router is SIGSTOPped: connections are accepted and never answered, requests hang."""
    proc, run_dir, out = start_cli_run(tmp_path)
    try:
        wait_output(proc, out, "step 1/1000")
        os.killpg(group_logging_to(run_dir / "router.log"), signal.SIGSTOP)
        stop_s = stop_and_check(proc, run_dir, out, signal.SIGINT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "interrupted" in out.read_text()
    print(f"\nfigures: SIGINT with the router hung -> exited, everything stopped, in {stop_s:.1f} s")
