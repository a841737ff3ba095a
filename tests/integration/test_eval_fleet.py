"""Posture fleet end to end, in one real run shared by the tests of this module: one rollout engine,
one eval engine behind its own router, the real torch trainer.

Faults: the eval engine is SIGKILLed while it starts (the first pin must recreate it); its
replacement runs in a mount namespace of its own, where `<volume>/eval/step_4` is covered by an
empty tmpfs: the orchestrator exports and validates step 4 normally, but the engine cannot see it and
refuses the load (like an eval pod without the volume's latest contents). That point must be skipped
`pin_violation` with nothing measured, every other point must be scored on the pinned version, and
training must not notice.
"""
from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import pytest_asyncio
from prometheus_client import REGISTRY

from rlfleet.crds.eval_specs import EvalDatasetSpec, EvalFleetTemplateSpec, EvalSpec
from rlfleet.crds.loader import load_training_run
from rlfleet.orchestrator.run.local import LocalRun, RunOptions
from rlfleet.orchestrator.run.progress import ProgressReporter
from rlfleet.util.binaries import python_executable

pytestmark = pytest.mark.engines

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RUN = "eval-fleet"
STEPS = 6
HIDDEN_STEP = 4


def namespaces_available() -> bool:
    if not (shutil.which("unshare") and shutil.which("nsenter")):
        return False
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    return probe.returncode == 0


def mount_namespace(pid: int | str) -> str:
    return os.readlink(f"/proc/{pid}/ns/mnt")


async def eval_engine_pid(local: LocalRun, incarnation: int) -> int:
    """The pid of the eval engine's given incarnation, once it runs in its own mount namespace."""
    async with asyncio.timeout(600):
        while True:
            evaluator = local.evaluation.evaluator if local.evaluation else None
            if evaluator is not None:
                slot = evaluator.runtime.backend.engines()[0]
                process = evaluator.runtime.backend.process(0)
                if slot.incarnation == incarnation and process is not None and process.pid is not None:
                    try:
                        if mount_namespace(process.pid) != mount_namespace("self"):
                            return process.pid
                    except FileNotFoundError:
                        pass
            await asyncio.sleep(0.1)


async def inject_faults(local: LocalRun, hidden: Path) -> None:
    """SIGKILL the eval engine while it starts (the first pin must recreate it), then hide `hidden`
    from the replacement."""
    first = await eval_engine_pid(local, 1)
    os.killpg(first, signal.SIGKILL)
    second = await eval_engine_pid(local, 2)
    done = await asyncio.create_subprocess_exec(
        "nsenter", "-t", str(second), "-m", "--", "mount", "-t", "tmpfs", "-o", "size=1m", "rlfleet-test-hidden",
        str(hidden), stderr=asyncio.subprocess.PIPE)
    _, err = await done.communicate()
    assert done.returncode == 0, err.decode()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fleet_run(tmp_path_factory):
    if not namespaces_available():
        pytest.skip("needs unshare/nsenter with mount namespaces (CAP_SYS_ADMIN) to inject the load failure")
    root = tmp_path_factory.mktemp("eval-fleet")
    wrapper = root / "engine-in-own-mount-namespace"
    wrapper.write_text(f'#!/bin/sh\nexec unshare --mount --propagation private -- {python_executable()} "$@"\n')
    wrapper.chmod(0o755)
    volume = root / "volume"
    (volume / "eval" / f"step_{HIDDEN_STEP}").mkdir(parents=True)

    run = load_training_run(EXAMPLES / "quickstart.yaml")
    run.metadata.name = RUN
    spec = run.spec
    spec.trainer.steps = STEPS
    spec.trainer.prompts_per_step = 4
    spec.rollout.replicas = 1
    spec.rollout.min_ready_engines = 1
    spec.weight_sync.snapshot_volume.local_path = str(volume)
    spec.eval = EvalSpec(
        posture="fleet", interval_steps=2, eval_before_train=True, max_in_flight=2, overflow_policy="backpressure",
        keep_snapshots=2, pin_retries=2,
        datasets=[EvalDatasetSpec(name="reverse", task="reverse", max_prompts=12, max_new_tokens=8)],
        fleet=EvalFleetTemplateSpec(replicas=1, min_ready_engines=1))
    log = io.StringIO()
    local = LocalRun(run, RunOptions(run_dir=root / "run", summary_path=root / "summary.json", metrics_port=0,
                                     progress=ProgressReporter(log, tty=False), eval_engine_python=str(wrapper)))
    skipped_before = REGISTRY.get_sample_value("rlfleet_eval_skipped_total",
                                               {"run": RUN, "reason": "pin_violation"}) or 0.0
    run_task = asyncio.create_task(local.execute())
    hider = asyncio.create_task(inject_faults(local, volume / "eval" / f"step_{HIDDEN_STEP}"))
    done, _ = await asyncio.wait([run_task, hider], return_when=asyncio.FIRST_EXCEPTION)
    if hider in done and hider.exception() is not None:
        run_task.cancel()
        await asyncio.gather(run_task, return_exceptions=True)
        raise hider.exception()
    await run_task
    summary = json.loads((root / "summary.json").read_text())
    return {"local": local, "summary": summary, "log": log.getvalue(), "volume": volume,
            "skipped_before": skipped_before}


async def test_scores_are_recorded_at_their_steps_on_the_pinned_version(fleet_run):
    summary = fleet_run["summary"]
    points = {p["step"]: p for p in summary["eval"]}
    assert sorted(points) == [0, 2, 4, 6], fleet_run["log"]
    for step in (0, 2, 6):
        point = points[step]
        assert point["skipped"] is None, (point, fleet_run["log"])
        assert point["posture"] == "fleet"
        assert point["weight_version"] == str(step)
        assert point["engine_versions"] == {"0": str(step)}  # every eval engine read back the pin
        assert point["mixed_version_ratio"] == 0.0
        assert point["datasets"]["reverse"]["samples"] == 12
        assert 0.0 <= point["scores"]["reverse"] <= 1.0
        assert point["export_seconds"] is not None and point["seconds"] > 0
    assert REGISTRY.get_sample_value("rlfleet_eval_score_step", {"run": RUN}) == 6
    # The summary rounds scores to 6 decimals; the gauge holds the exact mean.
    assert REGISTRY.get_sample_value("rlfleet_eval_score", {"run": RUN, "dataset": "reverse"}) == \
        pytest.approx(points[6]["scores"]["reverse"], abs=1e-6)


async def test_an_engine_that_cannot_load_the_snapshot_makes_the_point_a_pin_violation(fleet_run):
    point = next(p for p in fleet_run["summary"]["eval"] if p["step"] == HIDDEN_STEP)
    assert point["skipped"] == "pin_violation", point
    assert point["scores"] == {} and point["weight_version"] is None  # nothing measured on mixed weights
    assert point["engine_versions"] == {"0": "2"}, point  # the engine kept serving the previous pin
    assert "refused" in point["detail"]
    skipped = REGISTRY.get_sample_value("rlfleet_eval_skipped_total", {"run": RUN, "reason": "pin_violation"})
    assert skipped - fleet_run["skipped_before"] == 1
    status = fleet_run["local"].evaluation.last_eval_status()
    assert status.step == STEPS and status.skipped == {"pin_violation": 1} and status.weight_version == str(STEPS)


async def test_the_dead_eval_engine_was_recreated_before_the_first_pin(fleet_run):
    backend = fleet_run["local"].evaluation.evaluator.runtime.backend
    slot = backend.engines()[0]
    assert slot.restarts == 1 and slot.incarnation == 2
    assert "process exited" in (slot.last_failure or ""), slot
    first = next(p for p in fleet_run["summary"]["eval"] if p["step"] == 0)
    assert first["skipped"] is None and first["engine_versions"] == {"0": "0"}


async def test_training_is_unaffected_by_the_skipped_point(fleet_run):
    summary = fleet_run["summary"]
    assert summary["failure"] is None
    assert summary["steps_completed"] == STEPS
    assert summary["engines_marked_dead"] == 0, fleet_run["log"]
    for step, versions in summary["weight_versions_per_step"].items():
        assert versions and all(int(v) < int(step) for v in versions), (step, versions)


async def test_exactly_keep_snapshots_eval_snapshots_remain(fleet_run):
    eval_dir = fleet_run["volume"] / "eval"
    assert sorted(p.name for p in eval_dir.iterdir()) == [f"step_{HIDDEN_STEP}", f"step_{STEPS}"]
    assert fleet_run["summary"]["eval_snapshots_left"] == 2
    assert all((eval_dir / name / ".complete").exists() for name in (f"step_{HIDDEN_STEP}", f"step_{STEPS}"))
    assert REGISTRY.get_sample_value("rlfleet_eval_snapshots", {"run": RUN}) == 2
