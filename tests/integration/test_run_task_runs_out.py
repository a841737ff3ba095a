"""A run whose task holds fewer prompts than its steps need, on real parts (a real SGLang CPU engine, the
real sglang-router, the real torch trainer): it trains the steps its prompts fill, then fails at once
saying the prompts ran out, not at the step's rollout timeout as "only k of N groups arrived"."""
from __future__ import annotations

import asyncio
import io
import sys
import types
from pathlib import Path

import pytest

from rlfleet.orchestrator.run.local import LocalRun, RunFailed, RunOptions
from rlfleet.orchestrator.run.progress import ProgressReporter

pytestmark = pytest.mark.engines

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEP_GROUP_TIMEOUT_S = 900.0  # the default: the failure must come long before it


def six_rotations(seed: int):
    """A finite task: six prompts of the rotate kind ("abc=" -> "bcd")."""
    words = ["abc", "bcd", "cde", "def", "efg", "fgh"]
    return [(f"{w}=", "".join(chr(ord(c) + 1) for c in w)) for w in words]


async def test_a_task_whose_prompts_run_out_fails_the_run_at_once_saying_so(tmp_path: Path, monkeypatch):
    from rlfleet.crds.loader import load_training_run

    module = types.ModuleType("finite_task_module")
    module.six_rotations = six_rotations
    monkeypatch.setitem(sys.modules, "finite_task_module", module)
    run = load_training_run(EXAMPLES / "quickstart.yaml")
    run.spec.trainer.steps = 3
    run.spec.trainer.prompts_per_step = 4  # step 1 takes four of the six prompts; step 2 cannot be filled
    run.spec.trainer.samples_per_prompt = 4
    run.spec.trainer.task = "finite_task_module:six_rotations"
    run.spec.rollout.replicas = 1
    run.spec.eval = None
    log = io.StringIO()
    options = RunOptions(run_dir=tmp_path / "run", metrics_port=0, progress=ProgressReporter(log, tty=False),
                         step_group_timeout_s=STEP_GROUP_TIMEOUT_S)
    local = LocalRun(run, options)
    # Engine start, one step and the failure take about a minute; the step timeout alone would take 15.
    async with asyncio.timeout(STEP_GROUP_TIMEOUT_S * 2 / 3):
        with pytest.raises(RunFailed) as failed:
            await local.execute()
    assert failed.value.reason == "TaskPromptsExhausted", log.getvalue()
    assert failed.value.message.startswith("the task's prompts ran out after 6 groups (a task must be endless")
    assert local.summary.failure == f"TaskPromptsExhausted: {failed.value.message}"
    assert len(local.summary.steps) == 1, log.getvalue()  # the step its prompts filled was trained
