"""The Python loader and `rlfleet validate`: field paths, rule messages, YAML as the API server reads it."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from helpers.manifests import RUN, errors
from rlfleet.crds.loader import ManifestError, load_text, load_training_run, validate_update
from rlfleet.crds.validate_cli import main as validate_main

REPO = Path(__file__).resolve().parents[2]



def test_a_minimal_run_gets_every_default():
    (doc,) = load_text(RUN)
    spec = doc.obj.spec
    assert (spec.watchdog.window_seconds, spec.watchdog.check_interval_seconds, spec.watchdog.limit,
            spec.watchdog.checks) == (60, 30, 100, 10)
    assert (spec.heat_guard.pause_at_c, spec.heat_guard.resume_at_c) == (84.0, 74.0)
    assert spec.rollout.health.failure_threshold == 3 and spec.weight_sync.mode == "disk"
    assert spec.eval is None and spec.trainer.backend == "torch"


def test_several_documents_each_with_its_own_errors():
    text = RUN + "---\n" + RUN.replace("modelPath: tiny://llama", "modelPath: tiny://llama\n  watchdog: {checks: 0}")
    first, second = load_text(text)
    assert first.errors == [] and first.obj is not None
    assert [(e.path, e.rule) for e in second.errors] == [("spec.watchdog.checks", "greater_than_equal")]


def test_cross_field_rules_report_each_field_and_the_rule():
    found = errors(RUN + "  heatGuard: {resumeAtC: 90, minPauseSeconds: 500}\n")
    assert found == [
        ("spec.heatGuard.resumeAtC", "resumeAtC must be below pauseAtC"),
        ("spec.heatGuard.minPauseSeconds", "minPauseSeconds must not exceed maxPauseSeconds"),
    ]
    (doc,) = load_text(RUN + "  heatGuard: {resumeAtC: 90}\n")
    assert doc.errors[0].rule == "self.resumeAtC < self.pauseAtC"


def test_types_are_strict_like_the_api_server():
    assert errors(RUN + '  watchdog: {checks: "10"}\n') == [
        ("spec.watchdog.checks", 'Invalid value: "10": must be of type integer')
    ]
    assert errors(RUN + "  watchdog: {checks: 2.5}\n")[0][0] == "spec.watchdog.checks"
    assert errors(RUN + "  heatGuard: {enabled: 'yes'}\n")[0][0] == "spec.heatGuard.enabled"


def test_yaml_numbers_dates_and_duplicate_keys_read_as_the_api_server_reads_them():
    (doc,) = load_text(RUN + "  trainer: {learningRate: 1e-5}\n")
    assert doc.obj.spec.trainer.learning_rate == pytest.approx(1e-5)
    (doc,) = load_text(RUN.replace("tiny://llama", "2024-01-01"))
    assert doc.obj.spec.model_path == "2024-01-01"
    with pytest.raises(ManifestError, match="duplicate key"):
        load_text(RUN + "  modelPath: other\n")


def test_unknown_fields_kinds_and_enums_are_named():
    assert errors(RUN + "  rollout: {replica: 2}\n") == [("spec.rollout.replica",
                                                          'unknown field "spec.rollout.replica"')]
    assert errors(RUN + "  trainer: {backend: jax}\n") == [
        ("spec.trainer.backend", 'Unsupported value: "jax": supported values: "megatron", "torch"')
    ]
    assert errors(RUN.replace("TrainingRun", "Trainingrun"))[0][0] == "kind"
    assert errors(RUN.replace("v1alpha1", "v1"))[0][0] == "apiVersion"


def test_status_in_a_manifest_is_ignored_as_on_the_api_server():
    (doc,) = load_text(RUN + "status: {phase: Bogus}\n")
    assert doc.errors == [] and doc.obj.status is None


def test_errors_inside_lists_carry_the_index():
    text = (RUN + "  eval:\n    datasets:\n      - {name: a, task: reverse}\n"
            "      - {name: b, task: reverse, path: b.jsonl}\n")
    assert errors(text) == [("spec.eval.datasets[1].path", "set exactly one of path and task")]


def test_updates_may_not_change_immutable_fields():
    old = load_text(RUN)[0].data
    new = load_text(RUN.replace("tiny://llama", "tiny://qwen2") + "  trainer: {maxRestarts: 5}\n")[0].data
    assert [(e.path, e.message) for e in validate_update(old, new)] == [
        ("spec.modelPath", "modelPath is immutable once the object exists")
    ]
    steps = validate_update(old, load_text(RUN + "  trainer: {steps: 5}\n")[0].data)
    assert [(e.path, e.message.split(" is fixed")[0]) for e in steps] == [
        ("spec.trainer", "spec.trainer (all but maxRestarts)")]
    assert validate_update(old, load_text(RUN + "  trainer: {maxRestarts: 5}\n")[0].data) == []


def test_load_training_run_returns_the_run_or_every_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(RUN)
    assert load_training_run(path).metadata.name == "t"
    path.write_text(RUN + "  watchdog: {checks: 0, limit: -1}\n")
    with pytest.raises(ManifestError) as caught:
        load_training_run(path)
    assert [e.path for e in caught.value.errors] == ["spec.watchdog.limit", "spec.watchdog.checks"]


def test_a_file_of_fleets_only_is_not_a_local_run_and_says_where_fleets_go():
    with pytest.raises(ManifestError) as caught:
        load_training_run(REPO / "examples" / "serving-fleet.yaml")
    (error,) = caught.value.errors
    assert error.message == ("expected one TrainingRun, found 0 (and RolloutFleet: apply those to a cluster "
                             "with the rlfleet operator)")


def test_validate_cli_exit_status_and_output(tmp_path, capsys):
    assert validate_main([str(REPO / "examples" / "quickstart.yaml"),
                          str(REPO / "examples" / "gpu-megatron.yaml")]) == 0
    assert "TrainingRun/quickstart: valid" in capsys.readouterr().out
    assert validate_main(["-q", str(REPO / "examples")]) == 0  # a directory: every *.yaml in it
    assert capsys.readouterr().out == ""

    bad = tmp_path / "bad.yaml"
    bad.write_text(RUN + "  heatGuard: {resumeAtC: 90}\n---\n" + RUN.replace("name: t", "name: u"))
    assert validate_main([str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"{bad}: TrainingRun/t: spec.heatGuard.resumeAtC: resumeAtC must be below pauseAtC" in out
    assert f"{bad}: TrainingRun/u: valid" in out

    assert validate_main([str(tmp_path / "missing.yaml")]) == 1
    assert "cannot read" in capsys.readouterr().out

    previous = tmp_path / "previous.yaml"
    previous.write_text(RUN.replace("tiny://llama", "tiny://qwen2"))
    good = tmp_path / "good.yaml"
    good.write_text(RUN)
    assert validate_main(["--previous", str(previous), str(good)]) == 1
    assert "spec.modelPath: modelPath is immutable" in capsys.readouterr().out


def test_validate_is_a_cli_subcommand():
    from rlfleet.cli import COMMANDS

    assert COMMANDS["validate"][0] == "rlfleet.crds.validate_cli"


def test_duplicate_keys_are_named_by_their_field_path():
    with pytest.raises(ManifestError) as caught:
        load_text(RUN + "  rollout:\n    engine: {port: 31000, port: 32000}\n")
    assert [(e.path, e.message) for e in caught.value.errors] == [
        ("spec.rollout.engine.port", "duplicate key 'port' (line 7)")]
    with pytest.raises(ManifestError) as caught:
        load_text(RUN + "  eval:\n    datasets:\n      - {name: a, task: reverse, task: copy}\n")
    assert caught.value.errors[0].path == "spec.eval.datasets[0].task"


def test_integral_floats_are_integers_as_on_the_api_server():
    (doc,) = load_text(RUN + "  watchdog: {checks: 10.0, retripPeriodSeconds: 600.0}\n  rollout: {replicas: 2.0}\n")
    assert doc.errors == []
    assert (doc.obj.spec.watchdog.checks, doc.obj.spec.watchdog.retrip_period_seconds,
            doc.obj.spec.rollout.replicas) == (10, 600, 2)
    assert type(doc.obj.spec.watchdog.checks) is int
    assert errors(RUN + "  watchdog: {checks: 2.5}\n") == [
        ("spec.watchdog.checks", "Invalid value: 2.5: must be of type integer")]
    assert errors(RUN + "  heatGuard: {enabled: 1.0}\n")[0][0] == "spec.heatGuard.enabled"


def test_weight_sync_fields_are_checked_and_named():
    (doc,) = load_text(RUN + "  trainer: {gpus: 0}\n  rollout: {engine: {device: cpu}}\n"
                       "  weightSync: {mode: broadcast, bucketMegabytes: 64, verifyEvery: 5, diskVerify: full}\n")
    assert not doc.errors
    ws = doc.obj.spec.weight_sync
    assert (ws.mode, ws.bucket_megabytes, ws.verify_every, ws.disk_verify, ws.fallback_to_disk) == (
        "broadcast", 64, 5, "full", True)
    for bad, path in (("mode: nccl", "spec.weightSync.mode"), ("bucketMegabytes: 0", "spec.weightSync.bucketMegabytes"),
                      ("verifyEvery: -1", "spec.weightSync.verifyEvery"),
                      ("diskVerify: some", "spec.weightSync.diskVerify")):
        assert path in [p for p, _ in errors(RUN + f"  weightSync: {{{bad}}}\n")], bad
    mixed = errors(RUN + "  trainer: {gpus: 0}\n  rollout: {engine: {device: cuda}}\n  weightSync: {mode: broadcast}\n")
    assert [(p, m) for p, m in mixed if p == "spec.weightSync.mode" and "same kind of device" in m]
    # SGLang ranks an engine's processes in the update group by tensor-parallel rank alone.
    stages = errors(RUN + "  rollout: {engine: {pipelineParallelSize: 2, gpusPerEngine: 2}}\n"
                    "  weightSync: {mode: broadcast}\n")
    assert [p for p, m in stages if "several pipeline stages" in m] == ["spec.rollout.engine.pipelineParallelSize"]
    replicas = errors(RUN + "  rollout: {engine: {dataParallelSize: 2, gpusPerEngine: 2}}\n"
                      "  weightSync: {mode: broadcast}\n")
    assert [p for p, m in replicas if "data-parallel replicas" in m] == ["spec.rollout.engine.dataParallelSize"]
    assert errors(RUN + "  rollout: {engine: {dataParallelSize: 2, tensorParallelSize: 2, gpusPerEngine: 2, "
                  "extraArgs: [--enable-dp-attention]}}\n  weightSync: {mode: broadcast}\n") == []
    assert errors(RUN + "  rollout: {engine: {pipelineParallelSize: 2, gpusPerEngine: 2}}\n") == []  # disk: fine
    # The trainer pod's update-group port is not the metrics port's to take.
    clash = errors(RUN + "  metricsPort: 29600\n  weightSync: {mode: broadcast}\n")
    assert [(p, m) for p, m in clash if p == "spec.metricsPort" and "update-group port" in m], clash
    assert errors(RUN + "  metricsPort: 29600\n") == []


def test_checkpoint_fields_are_checked_naming_the_field():
    (doc,) = load_text(RUN + "  checkpoint: {intervalSteps: 3}\n")
    assert doc.errors == [] and doc.obj.spec.checkpoint.keep == 2 and doc.obj.spec.checkpoint.path == "checkpoints"
    assert errors(RUN + "  checkpoint: {keep: 2}\n")[0][0] == "spec.checkpoint.intervalSteps"
    assert errors(RUN + "  checkpoint: {intervalSteps: 0}\n")[0][0] == "spec.checkpoint.intervalSteps"
    assert errors(RUN + "  checkpoint: {intervalSteps: 3, keep: 0}\n")[0][0] == "spec.checkpoint.keep"
    for path in ("/abs", "a/../../b", "./x", "a//b"):
        found = errors(RUN + f"  checkpoint: {{intervalSteps: 3, path: '{path}'}}\n")
        assert found and found[0][0] == "spec.checkpoint.path", (path, found)
    gpu = RUN + "  trainer: {backend: megatron, gpus: 1}\n  checkpoint: {intervalSteps: 3}\n"
    assert errors(gpu) == []  # on GPUs the distributed optimizer's state is gathered into the checkpoint


def test_fields_that_would_be_ignored_are_refused_where_they_take_no_effect():
    """A field accepted where it has no effect would be silently ignored: each is refused there, naming it."""
    refused = {
        "  weightSync: {fallbackToDisk: false}\n": "spec.weightSync.fallbackToDisk",
        "  weightSync: {bucketMegabytes: 64}\n": "spec.weightSync.bucketMegabytes",
        "  weightSync: {snapshotVolume: {claimName: c, size: 1Ti}}\n": "spec.weightSync.snapshotVolume.size",
        "  heatGuard: {source: {type: file, path: /t, url: 'http://d:9400/metrics'}}\n": "spec.heatGuard.source.url",
        "  heatGuard: {source: {type: dcgm, url: 'http://d:9400/metrics', path: /t}}\n": "spec.heatGuard.source.path",
        "  eval: {datasets: [{name: a, task: reverse}], keepSnapshots: 3}\n": "spec.eval.keepSnapshots",
        "  eval: {datasets: [{name: a, task: reverse}], pinTimeoutSeconds: 30}\n": "spec.eval.pinTimeoutSeconds",
        "  eval: {posture: external, external: {classPath: 'm:C'}, routerProbeTimeoutSeconds: 30}\n":
            "spec.eval.routerProbeTimeoutSeconds",
        "  eval: {datasets: [{name: a, task: reverse, labelKey: y}]}\n": "spec.eval.datasets[0].labelKey",
    }
    for text, path in refused.items():
        assert [p for p, _ in errors(RUN + text)] == [path], text
    # Where they take effect, and their defaults anywhere, are accepted.
    for text in ("  weightSync: {mode: broadcast, fallbackToDisk: false, bucketMegabytes: 64}\n",
                 "  weightSync: {fallbackToDisk: true, bucketMegabytes: 512, snapshotVolume: {claimName: c}}\n",
                 "  heatGuard: {source: {type: dcgm, url: 'http://d:9400/metrics'}}\n",
                 "  eval: {datasets: [{name: a, path: a.jsonl, inputKey: q, labelKey: y}], keepSnapshots: 2}\n",
                 "  eval: {posture: external, external: {classPath: 'm:C'}, keepSnapshots: 4}\n"):
        assert errors(RUN + text) == [], text


def test_a_local_run_refuses_the_fields_that_shape_pods_naming_each_and_what_it_uses_instead(tmp_path):
    from rlfleet.crds.loader import local_run_errors

    doc = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    spec = doc["spec"]
    spec["trainer"]["nodeSelector"] = {"pool": "gpu"}
    spec["rollout"]["engine"].update(port=31000, image="lmsysorg/sglang:v0.5.23")  # the image's default: no effect
    spec["rollout"]["router"] = {"image": "example.com/router:1"}
    spec["eval"]["fleet"]["engine"] = {"tolerations": [{"key": "gpu", "operator": "Exists"}],
                                       "nodeSelector": {}}  # an override to the default: no effect, no error
    spec["weightSync"] = {"mode": "disk", "snapshotVolume": {"claimName": "snaps"}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    errors = local_run_errors(load_training_run(path))
    assert [e.path for e in errors] == [
        "spec.trainer.nodeSelector", "spec.rollout.engine.port", "spec.rollout.router.image",
        "spec.eval.fleet.engine.tolerations", "spec.weightSync.snapshotVolume.claimName"]
    assert all(e.rule == "local" and "leave it out" in e.message for e in errors)
    assert "free ports it picks" in errors[1].message
    assert local_run_errors(load_training_run(REPO / "examples" / "quickstart.yaml")) == []


def test_gpus_per_engine_on_a_cpu_engine_is_refused():
    assert [path for path, _ in errors(RUN + "  rollout: {engine: {device: cpu, gpusPerEngine: 2}}\n")] == [
        "spec.rollout.engine.gpusPerEngine"]
    assert errors(RUN + "  rollout: {engine: {device: cpu, gpusPerEngine: 0}}\n") == []


def test_an_eval_engine_the_overrides_leave_short_of_gpus_is_refused_naming_the_override(tmp_path):
    doc = yaml.safe_load((REPO / "examples" / "gpu-megatron.yaml").read_text())
    doc["spec"]["eval"]["fleet"]["engine"] = {"tensorParallelSize": 2, "gpusPerEngine": 1}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ManifestError) as refused:
        load_training_run(path)
    assert [e.path for e in refused.value.errors] == ["spec.eval.fleet.engine.gpusPerEngine"]
    assert validate_main([str(path)]) == 1  # `rlfleet validate` says so too
    doc["spec"]["eval"]["fleet"]["engine"] = {"device": "cpu"}  # a cpu eval engine inherits no GPU count
    path.write_text(yaml.safe_dump(doc))
    assert load_training_run(path).spec.eval.fleet.engine.device == "cpu"
