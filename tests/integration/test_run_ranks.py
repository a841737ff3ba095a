"""`rlfleet run FILE` with a trainer of two ranks (megatron tensor parallel 2, and torch's FSDP replicas;
gloo, real ranks from the elastic launcher): each run finishes with rank 0 running the loop and the
engines; a rank SIGKILLed mid-run fails the run naming that rank with its last log lines, and nothing of
the run is left running.

One real SGLang CPU engine behind the real router, the quickstart shortened (no eval).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlfleet.util.procs import groups_writing_under

pytestmark = pytest.mark.engines

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RLFLEET = [sys.executable, "-P", "-m", "rlfleet.cli"]


MEGATRON_TP2 = {"backend": "megatron", "tensorParallelSize": 2}


def two_rank_run(tmp_path: Path, steps: int, trainer: dict | None = None) -> Path:
    doc = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    spec = doc["spec"]
    spec["trainer"].update(trainer or MEGATRON_TP2, steps=steps, promptsPerStep=4, samplesPerPrompt=4)
    spec["rollout"]["replicas"] = 1
    spec.pop("eval", None)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def ranks_of(parent: int) -> dict[int, int]:
    """rank -> pid of the launcher's rank processes (each writes its stdout to the launcher's rank log)."""
    found = {}
    for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        try:
            stdout = os.readlink(f"/proc/{child}/fd/1")
        except OSError:
            continue
        parts = Path(stdout).parts
        if stdout.endswith("stdout.log") and len(parts) > 2 and parts[-3].startswith("attempt_"):
            found[int(parts[-2])] = int(child)
    return found


def test_a_layout_the_model_cannot_take_is_refused_before_anything_starts(tmp_path, capsys):
    from rlfleet.orchestrator.run.cli import main

    path = two_rank_run(tmp_path, steps=3)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["trainer"]["tensorParallelSize"] = 4  # the tiny model has 2 key/value heads
    path.write_text(yaml.safe_dump(doc))
    assert main([str(path), "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "TrainerSetupFailed" in err
    assert "spec.trainer.tensorParallelSize 4 does not divide the model's num_key_value_heads 2" in err
    assert not (tmp_path / "run").exists(), "something started"


def test_a_trainer_of_several_ranks_outside_a_launch_is_refused(tiny_model):
    from rlfleet.crds.loader import load_training_run
    from rlfleet.orchestrator.run.trainer_setup import build_rank_trainer

    run = load_training_run(EXAMPLES / "quickstart.yaml")
    run.spec.trainer.data_parallel_size = 2
    with pytest.raises(ValueError, match="asks for 2 ranks .* not started as one of them"):
        build_rank_trainer(run.spec, tiny_model)


@pytest.mark.parametrize(("trainer", "says"), [
    (MEGATRON_TP2, "megatron trainer: 2 rank(s) (tensor 2 x pipeline 1 x data 1) on cpu, gloo"),
    ({"backend": "torch", "dataParallelSize": 2, "dataParallelMode": "fsdp"},
     "torch trainer: 2 rank(s) (tensor 1 x pipeline 1 x data 2, replicas sharded (fsdp)) on cpu, gloo"),
], ids=["megatron-tp2", "torch-fsdp-dp2"])
def test_run_with_two_ranks_finishes(tmp_path, trainer, says):
    run_dir = tmp_path / "run"
    result = subprocess.run([*RLFLEET, "run", str(two_rank_run(tmp_path, 3, trainer)), "--run-dir", str(run_dir),
                             "--metrics-port", "0", "--summary", str(tmp_path / "summary.json")],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "starting 2 trainer ranks" in result.stderr
    assert says in result.stdout + result.stderr
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["steps_completed"] == 3 and data["failure"] is None, data
    assert all(versions for versions in data["engine_versions_per_step"].values()), data
    assert (run_dir / "trainer-ranks" / "rank-1.log").is_file()
    assert not groups_writing_under(run_dir), "processes of the run are still running"


def test_a_rank_killed_mid_run_fails_the_run_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    out, err = (tmp_path / "stdout.txt").open("w"), (tmp_path / "stderr.txt").open("w")
    proc = subprocess.Popen([*RLFLEET, "run", str(two_rank_run(tmp_path, steps=50)), "--run-dir", str(run_dir),
                             "--metrics-port", "0"],
                            stdout=out, stderr=err, text=True)
    try:
        deadline = time.monotonic() + 600
        # Wait for a finished step (rank 0 has then trained with rank 1 and synced the engine).
        while "step 1/50" not in rank0_output(run_dir):
            assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-4000:]
            assert time.monotonic() < deadline, "no step within 600 s"
            time.sleep(1)
        ranks = ranks_of(proc.pid)
        assert set(ranks) == {0, 1}, ranks
        os.kill(ranks[1], signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        out.close()
        err.close()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 1, stderr[-4000:]
    assert "FAILED (TrainerRankFailed): trainer rank 1 was killed by SIGKILL" in stderr, stderr[-4000:]
    assert "last log lines" in stderr
    assert not groups_writing_under(run_dir), "processes of the run are still running"


def rank0_output(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in run_dir.glob("trainer-ranks/elastic/*/attempt_*/0/*.log"))
