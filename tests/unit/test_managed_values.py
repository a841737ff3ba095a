"""Flags and environment variables rlfleet manages: derived from the builders, refused in a spec, and
Secret/ConfigMap references carried into the pods the operator builds."""
from __future__ import annotations

import argparse
import itertools

import pytest

from helpers.manifests import RUN, errors
from rlfleet.crds.loader import load_text
from rlfleet.crds.managed import BUILDER_ENV, ENGINE_FLAGS, MANAGED_OPTION_STRINGS, USER_SETTABLE_ENGINE_FLAGS
from rlfleet.crds.specs import EngineSpec
from rlfleet.operator import builders as b
from rlfleet.sglang.launch import BASE_ENV, CPU_ENV, build_engine_launch


def _flags(args) -> set[str]:
    return {a for a in args if a.startswith("--")}


def test_the_managed_flags_are_exactly_what_the_command_builder_sets():
    """Every branch of the builder: the flags it emits are the table (and --dtype, which it yields to users)."""
    seen: set[str] = set()
    for device, sizes, optional, metrics in itertools.product(
        ("cpu", "cuda"), (1, 2), (False, True), (False, True)
    ):
        engine = EngineSpec.model_validate({
            "modelPath": "/m", "device": device, "tensorParallelSize": sizes, "pipelineParallelSize": sizes,
            "dataParallelSize": sizes, "expertParallelSize": sizes, "gpusPerEngine": 8 if device == "cuda" else 0,
            **({"maxTotalTokens": 100, "memFractionStatic": 0.5, "attentionBackend": "torch_native"}
               if optional else {}),
        })
        launch = build_engine_launch(engine, host="h", enable_metrics=metrics, api_key="k" if optional else None,
                                     base_gpu_id=2 if optional else None)
        seen |= _flags(launch.args)
    assert seen == {f.flag for f in ENGINE_FLAGS} | set(USER_SETTABLE_ENGINE_FLAGS)


def test_the_aliases_are_sglangs_own_and_the_prefix_rule_refuses_no_real_flag():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    by_option = {s: tuple(a.option_strings) for a in parser._actions for s in a.option_strings}
    for flag in ENGINE_FLAGS:
        assert set(by_option[flag.flag]) == set(flag.option_strings), flag
    # A real SGLang flag that is not managed but abbreviates a managed one would be refused: none is.
    unmanaged = set(by_option) - set(MANAGED_OPTION_STRINGS)
    assert [s for s in unmanaged if any(m.startswith(s) for m in MANAGED_OPTION_STRINGS)] == []


@pytest.mark.parametrize("arg", ["--port", "--port=31000", "--host", "--api-key", "--model-path", "--model",
                                 "--tp-size", "--tensor-parallel-size", "--ep", "--po", "--weight-version=3"])
def test_extra_args_may_not_set_a_managed_flag(arg):
    found = errors(RUN + f"  rollout: {{engine: {{extraArgs: [--chunked-prefill-size, '512', '{arg}', '1']}}}}\n")
    assert [path for path, _ in found] == ["spec.rollout.engine.extraArgs[2]"]
    assert "must not set (or abbreviate) a flag rlfleet manages" in found[0][1] and "--port" in found[0][1]


def test_extra_args_keep_what_rlfleet_does_not_manage():
    text = RUN + "  rollout: {engine: {device: cpu, extraArgs: [--dtype, bfloat16, --chunked-prefill-size=512]}}\n"
    (doc,) = load_text(text)
    assert doc.errors == []
    launch = build_engine_launch(doc.obj.spec.rollout.engine.model_copy(update={"model_path": "/m"}), host="h")
    assert launch.args.count("--dtype") == 1 and launch.args[-3:] == ("--dtype", "bfloat16",
                                                                      "--chunked-prefill-size=512")


def test_fleets_and_eval_overrides_check_extra_args_too():
    fleet = ("apiVersion: rlfleet.io/v1alpha1\nkind: RolloutFleet\nmetadata: {name: f}\n"
             "spec: {engine: {modelPath: /m, extraArgs: ['--host=0.0.0.0']}}\n")
    assert [p for p, _ in errors(fleet)] == ["spec.engine.extraArgs[0]"]
    text = RUN + ("  eval: {posture: fleet, datasets: [{name: r, task: reverse}],\n"
                  "         fleet: {engine: {extraArgs: [--port, '1']}}}\n")
    assert [p for p, _ in errors(text)] == ["spec.eval.fleet.engine.extraArgs[0]"]


@pytest.mark.parametrize("name", ["RLFLEET_SNAPSHOT_DIR", "RLFLEET_ANYTHING", "POD_IP", "POD_NAME", "POD_NAMESPACE"])
@pytest.mark.parametrize("where", ["trainer", "rollout: {engine"])
def test_reserved_env_names_are_refused(name, where):
    close = "}" if where == "trainer" else "}}"
    found = errors(RUN + f"  {where}: {{env: [{{name: OK, value: a}}, {{name: {name}, value: x}}]{close}\n")
    field = "spec.trainer.env[1].name" if where == "trainer" else "spec.rollout.engine.env[1].name"
    assert found == [(field, found[0][1])] and "is reserved" in found[0][1]


def test_every_variable_the_builders_set_is_reserved_or_a_default_the_user_replaces(tmp_path):
    run = {"apiVersion": "rlfleet.io/v1alpha1", "kind": "TrainingRun",
           "metadata": {"name": "r", "namespace": "ns", "uid": "u"},
           "spec": {"modelPath": "tiny://llama", "rollout": {"engine": {"device": "cpu"}}}}
    fleet = {**b.build_rollout_fleet(run), "metadata": {"name": "r-rollout", "namespace": "ns", "uid": "f"}}
    pod = b.build_engine_pod(fleet, 0)
    trainer = b.build_trainer_pod(run)
    group = {**run, "spec": {**run["spec"], "trainer": {"nodes": 2, "gpus": 0, "dataParallelSize": 2}}}
    member = b.build_trainer_pod(group, node=1)  # a trainer group's pod also gets its node rank
    names = {e["name"] for p in (pod, trainer, member)
             for c in p["spec"].get("initContainers", []) + p["spec"]["containers"] for e in c["env"]}
    defaults = set(BASE_ENV) | set(CPU_ENV) | {"PYTHONUNBUFFERED", "HF_HUB_OFFLINE"}
    assert names - defaults == set(BUILDER_ENV)


def test_value_from_and_user_defaults_reach_the_pods_without_duplicates():
    env = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
           {"name": "HF_HUB_OFFLINE", "value": "0"},
           {"name": "CFG", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "a.json", "optional": True}}}]
    run = {"apiVersion": "rlfleet.io/v1alpha1", "kind": "TrainingRun",
           "metadata": {"name": "r", "namespace": "ns", "uid": "u"},
           "spec": {"modelPath": "/m", "trainer": {"env": env}, "rollout": {"engine": {"env": env}}}}
    fleet = {**b.build_rollout_fleet(run), "metadata": {"name": "r-rollout", "namespace": "ns", "uid": "f"}}
    for pod in (b.build_engine_pod(fleet, 0), b.build_trainer_pod(run)):
        got = pod["spec"]["containers"][0]["env"]
        assert [e for e in got if e["name"] in ("HF_TOKEN", "HF_HUB_OFFLINE", "CFG")] == env
        names = [e["name"] for e in got]
        assert len(names) == len(set(names)), names


@pytest.mark.parametrize("env, path, says", [
    ("{name: A}", "spec.trainer.env[0].value", "exactly one of value and valueFrom"),
    ("{name: A, value: x, valueFrom: {secretKeyRef: {name: s, key: k}}}", "spec.trainer.env[0].value",
     "exactly one of value and valueFrom"),
    ("{name: A, valueFrom: {}}", "spec.trainer.env[0].valueFrom", "exactly one of secretKeyRef and configMapKeyRef"),
    ("{name: A, valueFrom: {secretKeyRef: {name: s, key: k}, configMapKeyRef: {name: c, key: k}}}",
     "spec.trainer.env[0].valueFrom", "exactly one of secretKeyRef and configMapKeyRef"),
    ("{name: A, valueFrom: {secretKeyRef: {name: Bad_Name, key: k}}}",
     "spec.trainer.env[0].valueFrom.secretKeyRef.name", "should match"),
    ("{name: A, valueFrom: {secretKeyRef: {name: s, key: 'a/b'}}}", "spec.trainer.env[0].valueFrom.secretKeyRef.key",
     "should match"),
    ("{name: A, valueFrom: {secretKeyRef: {name: s}}}", "spec.trainer.env[0].valueFrom.secretKeyRef.key",
     "Required value"),
])
def test_value_from_is_validated(env, path, says):
    found = errors(RUN + f"  trainer: {{env: [{env}]}}\n")
    assert any(p == path and says in m for p, m in found), found


def test_the_api_knows_exactly_the_trainers_built_in_tasks():
    from rlfleet.crds.eval_specs import BUILTIN_TASKS
    from rlfleet.trainer.tasks import TASKS

    assert set(BUILTIN_TASKS) == set(TASKS)
    assert errors(RUN + "  trainer: {task: reverse}\n") == []
    assert errors(RUN + "  trainer: {task: my.tasks:Words}\n") == []
    assert [p for p, _ in errors(RUN + "  trainer: {task: revers}\n")] == ["spec.trainer.task"]


def test_a_cpu_engine_preloads_the_malloc_library_it_is_given_and_a_users_ld_preload_wins(tmp_path):
    from rlfleet.sglang.launch import JEMALLOC_CONF
    from rlfleet.util.allocator import find_jemalloc

    cpu = EngineSpec.model_validate({"modelPath": "/m", "device": "cpu"})
    env = build_engine_launch(cpu, host="h", malloc_library="/lib/libjemalloc.so.2").env
    assert env["LD_PRELOAD"] == "/lib/libjemalloc.so.2" and env["MALLOC_CONF"] == JEMALLOC_CONF
    assert "LD_PRELOAD" not in build_engine_launch(cpu, host="h").env  # none on this machine: glibc's
    gpu = EngineSpec.model_validate({"modelPath": "/m", "device": "cuda"})
    assert "LD_PRELOAD" not in build_engine_launch(gpu, host="h", malloc_library="/lib/libjemalloc.so.2").env
    own = EngineSpec.model_validate({"modelPath": "/m", "device": "cpu",
                                     "env": [{"name": "LD_PRELOAD", "value": "/opt/libtcmalloc.so"}]})
    assert build_engine_launch(own, host="h", malloc_library="/lib/libjemalloc.so.2").env["LD_PRELOAD"] == \
        "/opt/libtcmalloc.so"

    present = tmp_path / "libjemalloc.so.2"
    present.write_bytes(b"")
    assert find_jemalloc((str(tmp_path / "missing.so"), str(present))) == str(present)
    assert find_jemalloc((str(tmp_path / "missing.so"),)) is None


@pytest.mark.parametrize(("cpus", "engines", "threads"), [(2, 1, 2), (2, 2, 1), (2, 3, 1), (16, 4, 4), (8, 3, 2)])
def test_cpu_engines_on_one_machine_share_its_cores(cpus, engines, threads):
    from rlfleet.sglang.launch import cpu_threads_per_engine

    assert cpu_threads_per_engine(cpus, engines) == threads


def test_cpu_threads_set_omp_threads_of_cpu_engines_unless_their_env_does():
    cpu = EngineSpec.model_validate({"modelPath": "/m", "device": "cpu"})
    assert build_engine_launch(cpu, host="h", cpu_threads=1).env["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in build_engine_launch(cpu, host="h").env  # pods: their CPU limit's business
    gpu = EngineSpec.model_validate({"modelPath": "/m", "device": "cuda"})
    assert "OMP_NUM_THREADS" not in build_engine_launch(gpu, host="h", cpu_threads=1).env
    own = EngineSpec.model_validate({"modelPath": "/m", "device": "cpu",
                                     "env": [{"name": "OMP_NUM_THREADS", "value": "3"}]})
    assert build_engine_launch(own, host="h", cpu_threads=1).env["OMP_NUM_THREADS"] == "3"
