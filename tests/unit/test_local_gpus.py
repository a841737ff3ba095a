"""A local run's GPUs: the trainer's ranks first, then each rollout engine slot, then each eval engine slot,
none shared; a machine with too few is refused before anything starts, naming the fields."""
from __future__ import annotations

import pytest

from rlfleet.crds.derive import eval_fleet_spec
from rlfleet.crds.loader import load_training_run
from rlfleet.crds.specs import EngineSpec
from rlfleet.orchestrator.guards.heat_guard import slot_by_gpu_index
from rlfleet.orchestrator.run.cli import main
from rlfleet.orchestrator.run.local_gpus import check_local_gpus, plan_local_gpus
from rlfleet.sglang.launch import build_engine_launch


def _plan(path: str):
    run = load_training_run(path)
    return plan_local_gpus(run.spec, eval_fleet_spec(run.metadata.name, run.spec))


def test_the_gpu_example_gives_trainer_rollout_and_eval_engines_gpus_of_their_own():
    plan = _plan("examples/gpu-megatron.yaml")  # trainer tp2 (2 GPUs), 2 engines of tp2, 2 eval engines of 1
    assert plan.trainer == range(0, 2)
    assert plan.rollout == (2, 4)
    assert plan.evaluation == (6, 7)
    assert plan.needed == 8
    assert plan.describe() == ("trainer GPUs 0-1, rollout engine 0 GPUs 2-3, rollout engine 1 GPUs 4-5, "
                               "eval engine 0 GPU 6, eval engine 1 GPU 7")
    check_local_gpus(plan, visible=8)
    with pytest.raises(ValueError) as refused:
        check_local_gpus(plan, visible=4)
    assert str(refused.value) == (
        "a local run gives the trainer and every CUDA engine GPUs of their own: spec.trainer.gpus 2 + "
        "spec.rollout.replicas 2 x spec.rollout.engine.gpusPerEngine 2 + spec.eval.fleet.replicas 2 x "
        "gpusPerEngine 1 = 8 GPUs, but this machine has 4 visible (CUDA_VISIBLE_DEVICES)")


def test_cpu_runs_need_no_gpu():
    plan = _plan("examples/quickstart.yaml")
    assert (plan.trainer, plan.rollout, plan.evaluation, plan.needed) == (range(0), (), (), 0)
    check_local_gpus(plan, visible=0)


def test_a_cuda_engine_starts_on_its_planned_gpu_and_a_cpu_engine_has_none():
    cuda = build_engine_launch(EngineSpec(model_path="/m", device="cuda", gpus_per_engine=2,
                                          tensor_parallel_size=2), host="h", base_gpu_id=4)
    assert cuda.args[cuda.args.index("--base-gpu-id") + 1] == "4"
    assert "--base-gpu-id" not in build_engine_launch(EngineSpec(model_path="/m", device="cuda"), host="h").args
    assert "--base-gpu-id" not in build_engine_launch(EngineSpec(model_path="/m", device="cpu"), host="h",
                                                      base_gpu_id=1).args


def test_rlfleet_run_refuses_a_run_this_machine_has_too_few_gpus_for(tmp_path, capsys):
    import torch

    visible = torch.cuda.device_count()
    manifest = tmp_path / "run.yaml"
    manifest.write_text(
        "apiVersion: rlfleet.io/v1alpha1\nkind: TrainingRun\nmetadata: {name: t}\nspec:\n"
        "  modelPath: tiny://llama\n"
        f"  rollout: {{replicas: {visible + 1}, engine: {{device: cuda}}}}\n"  # and the trainer's default 1 GPU
    )
    assert main([str(manifest), "--run-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert (f"cannot run here: a local run gives the trainer and every CUDA engine GPUs of their own: "
            f"spec.trainer.gpus 1 + spec.rollout.replicas {visible + 1} x spec.rollout.engine.gpusPerEngine 1 = "
            f"{visible + 2} GPUs, "
            f"but this machine has {visible} visible") in err
    assert not (tmp_path / "out").exists()  # refused before anything started


def test_the_heat_guard_reads_each_engines_planned_gpu():
    plan = _plan("examples/gpu-megatron.yaml")
    assert slot_by_gpu_index("rollout", 2, gpus_per_engine=2, gpu_bases=plan.rollout) == {2: "rollout-0",
                                                                                           4: "rollout-1"}
    # Without a plan (pods: each engine's GPUs counted from 0 on its node), slot n on GPUs n*gpusPerEngine..
    assert slot_by_gpu_index("rollout", 2, gpus_per_engine=2) == {0: "rollout-0", 2: "rollout-1"}
