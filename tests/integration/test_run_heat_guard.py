"""`rlfleet run` with the heat guard on: a real SGLang CPU engine paused by a file temperature source.

One engine (the machine is small): it runs hot from the start, so the guard pauses it as soon as it
serves, for longer than a hang takes to be marked dead; then it cools. The run must finish every
step, never mark the paused engine dead, and flag the step that overlapped the pause.
"""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
from pathlib import Path

import pytest

from rlfleet.orchestrator.fleet.health import hang_detection_bound
from rlfleet.orchestrator.run.local import LocalRun, RunOptions
from rlfleet.orchestrator.run.progress import ProgressReporter

pytestmark = pytest.mark.engines

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


async def wait_until(condition, timeout_s: float, what: str, task: asyncio.Task, log: io.StringIO) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            if task.done():
                raise AssertionError(f"run ended while waiting for {what}: {task.exception()}\n{log.getvalue()}")
            await asyncio.sleep(0.1)


async def test_a_hot_engine_is_paused_mid_run_without_being_marked_dead(tmp_path: Path):
    from rlfleet.crds.loader import load_training_run

    run = load_training_run(EXAMPLES / "quickstart.yaml")
    run.spec.trainer.steps = 2
    run.spec.rollout.replicas = 1
    run.spec.rollout.min_ready_engines = 1
    run.spec.eval = None
    temps = tmp_path / "gpu-temperatures"
    temps.write_text("rollout-0 93\n")
    run.spec.heat_guard = run.spec.heat_guard.model_validate({
        "enabled": True, "pauseAtC": 84, "resumeAtC": 74, "minPauseSeconds": 1, "maxPauseSeconds": 600,
        "pollIntervalSeconds": 0.5, "source": {"type": "file", "path": str(temps)}})
    log = io.StringIO()
    local = LocalRun(run, RunOptions(run_dir=tmp_path / "run", summary_path=tmp_path / "summary.json",
                                     metrics_port=0, progress=ProgressReporter(log, tty=False)))
    task = asyncio.create_task(local.execute())
    try:
        await wait_until(lambda: local.heat is not None and local.heat.paused_slots() == {"rollout-0"}, 900,
                         "the heat pause", task, log)
        assert local.fleet.monitor.held() == {0: "heat guard pause"}
        # Paused longer than a hang takes to be marked dead (the paused engine holds /health_generate).
        await asyncio.sleep(hang_detection_bound(run.spec.rollout.health) + 3)
        assert local.summary.engines_marked_dead == 0, log.getvalue()
        assert local.summary.steps == []  # no rollout while the only engine is paused
        temps.write_text("rollout-0 65\n")
        summary = await asyncio.wait_for(task, 900)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["steps_completed"] == data["steps_planned"] == 2, log.getvalue()
    assert data["engines_marked_dead"] == 0 and summary.failure is None
    assert data["heat_paused_per_step"] == {"1": True, "2": False}
    text = log.getvalue()
    assert "heat guard: pause rollout-0 (hot at 93 C)" in text
    assert "heat guard: resume rollout-0 (cooled at 65 C)" in text
    assert "overlapped a heat pause" in text
