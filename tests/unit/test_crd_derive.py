"""Pure derivations from a TrainingRun: engine specs, the eval engine merge, fleet specs, tiny models."""
from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from rlfleet.crds.derive import (
    TinyModelRef,
    eval_engine,
    eval_fleet_spec,
    parse_tiny_model,
    rollout_engine,
    rollout_fleet_spec,
)
from rlfleet.crds.eval_specs import EngineOverridesSpec, effective_eval_engine
from rlfleet.crds.loader import load_training_run
from rlfleet.crds.models import TrainingRunSpec
from rlfleet.crds.specs import EngineSpec

REPO = Path(__file__).resolve().parents[2]


def rollout(**fields) -> EngineSpec:
    return EngineSpec(model_path="/m", **fields)


def test_unset_overrides_inherit_everything():
    base = rollout(tensor_parallel_size=2, gpus_per_engine=2, attention_backend="fa3", extra_args=["--x"])
    assert effective_eval_engine(base, EngineOverridesSpec()) == base


def test_an_override_replaces_only_its_field():
    base = rollout(mem_fraction_static=0.8, env=[{"name": "A", "value": "1"}])
    merged = effective_eval_engine(base, EngineOverridesSpec(mem_fraction_static=0.5))
    assert merged.mem_fraction_static == 0.5 and merged.env == base.env and merged.model_path == "/m"


def test_a_different_tensor_parallel_size_resets_the_coupled_settings():
    base = rollout(tensor_parallel_size=8, expert_parallel_size=8, data_parallel_size=2, pipeline_parallel_size=2,
                   gpus_per_engine=32)
    merged = effective_eval_engine(base, EngineOverridesSpec(tensor_parallel_size=1))
    assert (merged.tensor_parallel_size, merged.expert_parallel_size, merged.data_parallel_size,
            merged.pipeline_parallel_size, merged.gpus_per_engine) == (1, 1, 1, 1, 1)


def test_explicit_overrides_win_over_the_fallback():
    base = rollout(tensor_parallel_size=8, expert_parallel_size=8, gpus_per_engine=8)
    merged = effective_eval_engine(base, EngineOverridesSpec(tensor_parallel_size=2, expert_parallel_size=2,
                                                             gpus_per_engine=4))
    assert (merged.tensor_parallel_size, merged.expert_parallel_size, merged.gpus_per_engine) == (2, 2, 4)


def test_same_tensor_parallel_size_keeps_the_coupled_settings():
    base = rollout(tensor_parallel_size=2, expert_parallel_size=2, gpus_per_engine=2)
    merged = effective_eval_engine(base, EngineOverridesSpec(tensor_parallel_size=2, image="other"))
    assert merged.expert_parallel_size == 2 and merged.image == "other"


def test_cpu_engines_keep_zero_gpus_when_tp_changes():
    base = rollout(device="cpu", gpus_per_engine=0)
    assert effective_eval_engine(base, EngineOverridesSpec(tensor_parallel_size=2)).gpus_per_engine == 0


def test_overrides_cannot_name_another_model():
    assert "model_path" not in EngineOverridesSpec.model_fields
    assert set(EngineOverridesSpec.model_fields) == set(EngineSpec.model_fields) - {"model_path"}


def test_quickstart_fleets():
    run = load_training_run(REPO / "examples" / "quickstart.yaml")
    fleet = rollout_fleet_spec("quickstart", run.spec)
    assert fleet.replicas == 2 and fleet.engine.device == "cpu" and fleet.engine.model_path == "tiny://llama?seed=0"
    assert fleet.snapshots.claim_name == "quickstart-snapshots" and fleet.run_name == "quickstart"
    evals = eval_fleet_spec("quickstart", run.spec)
    assert evals.replicas == 1 and evals.engine == fleet.engine and evals.health == fleet.health


def test_gpu_example_eval_fleet_uses_tp1_and_the_named_claim():
    run = load_training_run(REPO / "examples" / "gpu-megatron.yaml")
    engine = eval_engine(run.spec)
    assert (engine.tensor_parallel_size, engine.gpus_per_engine) == (1, 1)
    assert rollout_engine(run.spec).tensor_parallel_size == 2
    assert eval_fleet_spec("r", run.spec).snapshots.claim_name == "qwen3-4b-snapshots"


def test_no_eval_fleet_without_posture_fleet():
    spec = TrainingRunSpec(model_path="/m", eval={"datasets": [{"name": "a", "task": "reverse"}]})
    assert eval_engine(spec) is None and eval_fleet_spec("r", spec) is None


def test_rollout_engines_serve_the_runs_model():
    assert rollout_engine(TrainingRunSpec(model_path="/trainer-model")).model_path == "/trainer-model"
    same = TrainingRunSpec(model_path="/trainer-model", rollout={"engine": {"model_path": "/trainer-model"}})
    assert rollout_engine(same).model_path == "/trainer-model"
    # Another model would be served at step 0 while the trainer scores its own: refused, naming the field.
    with pytest.raises(ValidationError, match="rollout.engine.modelPath"):
        TrainingRunSpec(model_path="/trainer-model", rollout={"engine": {"model_path": "/served"}})


@pytest.mark.parametrize(
    "path, expected",
    [
        ("tiny://llama", TinyModelRef("llama", 0)),
        ("tiny://qwen2?seed=7", TinyModelRef("qwen2", 7)),
        ("/models/tiny", None),
        ("Qwen/Qwen3-4B", None),
    ],
)
def test_tiny_model_paths(path, expected):
    assert parse_tiny_model(path) == expected


def test_bad_tiny_model_path():
    with pytest.raises(ValueError, match="tiny://llama"):
        parse_tiny_model("tiny://gpt2")
    assert TinyModelRef("llama", 3).cache_name == "tiny-llama-seed3"


def test_engine_parallelism_reaches_the_sglang_command_line():
    from rlfleet.sglang.launch import build_engine_launch

    engine = EngineSpec(model_path="/m", tensor_parallel_size=2, expert_parallel_size=2, gpus_per_engine=2)
    args = list(build_engine_launch(engine, host="127.0.0.2").args)
    assert args[args.index("--tp-size") + 1] == "2" and args[args.index("--ep-size") + 1] == "2"
    assert "--pp-size" not in args and "--dp-size" not in args


def test_tiny_model_match_is_lenient_where_the_parser_is_strict():
    from rlfleet.crds.derive import match_tiny_model

    assert match_tiny_model("tiny://qwen2?seed=7") == parse_tiny_model("tiny://qwen2?seed=7")
    assert match_tiny_model("tiny://gpt2") is None and match_tiny_model("/models/tiny") is None


def test_status_is_written_with_the_fields_given_only():
    from rlfleet.crds.status import EngineSlotStatus, TrainingRunStatus, ready_text, status_dump

    assert ready_text(1, 3) == "1/3"
    copied = {"slot": 0, "state": "Dead", "restarts": 1, "lastFailure": {"reason": "Crashed", "exitCode": 1}}
    status = TrainingRunStatus(phase="Running", message="", ready_engines=1, total_engines=3,
                               engines=[EngineSlotStatus.model_validate(copied)])
    assert status_dump(status) == {"phase": "Running", "message": "", "readyEngines": 1, "totalEngines": 3,
                                   "ready": "1/3", "engines": [copied]}


def test_an_eval_engine_on_cuda_asks_for_the_gpus_of_its_own_layout():
    from rlfleet.crds.eval_specs import EngineOverridesSpec, effective_eval_engine
    from rlfleet.crds.specs import EngineSpec

    def gpus(rollout: dict, **overrides) -> int:
        engine = EngineSpec.model_validate({"modelPath": "/m", **rollout})
        return effective_eval_engine(engine, EngineOverridesSpec(**overrides)).gpus_per_engine

    # CPU rollout engines (no GPUs) and a cuda eval engine of tensor parallel 2: two GPUs.
    assert gpus({"device": "cpu", "gpusPerEngine": 0}, device="cuda", tensor_parallel_size=2) == 2
    # Only the pipeline grows: its GPUs follow.
    assert gpus({"device": "cuda"}, pipeline_parallel_size=2) == 2
    # The same layout: the rollout engines' count, when it is more.
    assert gpus({"device": "cuda", "gpusPerEngine": 4}, max_total_tokens=100) == 4
    # Set here: as given (the engine's own rule checks it).
    assert gpus({"device": "cuda", "gpusPerEngine": 4}, tensor_parallel_size=2, gpus_per_engine=8) == 8


def test_the_first_start_waits_at_least_an_engines_startup_bound():
    from rlfleet.crds.fleet_specs import RolloutTemplateSpec
    from rlfleet.orchestrator.run.loop import first_start_bound

    slow_model = RolloutTemplateSpec.model_validate({"health": {"startupTimeoutSeconds": 1200}})
    assert first_start_bound(slow_model) == 1200  # not waitAllAlive's 300
    long_syncs = RolloutTemplateSpec.model_validate({"health": {"startupTimeoutSeconds": 180},
                                                     "recovery": {"waitAllAliveTimeoutSeconds": 400}})
    assert first_start_bound(long_syncs) == 400
