"""The CRDs on a real kube-apiserver: install, examples, defaults, columns, explain, and bad input.

The bad-input table runs every manifest through BOTH the API server (`kubectl apply --dry-run=server`)
and the Python loader that local runs use, and requires both to reject it naming the same field; the
good rows require both to accept. So the CEL written next to each model and its Python predicate can
not drift apart unnoticed.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from rlfleet.crds.loader import load_text, validate_update
from rlfleet.crds.models import KINDS, TrainingRun
from rlfleet.crds.specs import wire_dump
from rlfleet.crds.status import Condition, EngineSlotStatus, LastEvalStatus, TrainingRunStatus
from rlfleet.operator import builders as b

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "crd-validation"
DELETE = object()  # a patch value that removes the key


def merged(base: dict, patch: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is DELETE:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def run_manifest(name: str, spec: dict) -> dict:
    return {"apiVersion": "rlfleet.io/v1alpha1", "kind": "TrainingRun", "metadata": {"name": name}, "spec": spec}


def fleet_manifest(kind: str, name: str, spec: dict) -> dict:
    return {"apiVersion": "rlfleet.io/v1alpha1", "kind": kind, "metadata": {"name": name}, "spec": spec}


BASE_RUN = run_manifest("base", {"modelPath": "tiny://llama?seed=0"})
BASE_EVAL = {"eval": {"posture": "shared", "datasets": [{"name": "reverse", "task": "reverse"}]}}
BASE_FLEET = {"replicas": 2, "engine": {"modelPath": "/models/tiny"}}


@dataclass(frozen=True)
class Case:
    """One manifest, what both checkers must say: the field path and a phrase of the message."""

    id: str
    patch: dict
    path: str | None  # None: both must accept it
    says: str = ""
    kind: str = "TrainingRun"
    base: dict = field(default_factory=dict)

    def manifest(self) -> dict:
        if self.kind == "TrainingRun":
            start = merged(BASE_RUN, {"metadata": {"name": self.id}, "spec": self.base})
        else:
            start = fleet_manifest(self.kind, self.id, BASE_FLEET)
        return merged(start, self.patch)


def spec(patch: dict) -> dict:
    return {"spec": patch}


BAD_INPUT: list[Case] = [
    Case("model-path-missing", spec({"modelPath": DELETE}), "spec.modelPath", "Required value"),
    Case("model-path-tiny-unknown", spec({"modelPath": "tiny://gpt2"}), "spec.modelPath", "tiny://llama or tiny://qwen2"),
    Case("name-too-long", {"metadata": {"name": "r" * 41}}, "metadata.name", "40"),
    Case("unknown-field", spec({"rollout": {"replica": 2}}), "spec.rollout.replica", "unknown field"),
    Case("backend-unknown", spec({"trainer": {"backend": "jax"}}), "spec.trainer.backend", "Unsupported value"),
    Case("gpus-string", spec({"trainer": {"gpus": "2"}}), "spec.trainer.gpus", "must be of type integer"),
    Case("samples-per-prompt-one", spec({"trainer": {"samplesPerPrompt": 1}}), "spec.trainer.samplesPerPrompt",
         "greater than or equal to 2"),
    Case("learning-rate-zero", spec({"trainer": {"learningRate": 0}}), "spec.trainer.learningRate", "greater than 0"),
    Case("torch-with-tensor-parallel", spec({"trainer": {"tensorParallelSize": 2, "gpus": 2}}),
         "spec.trainer.tensorParallelSize", "model parallelism needs backend megatron"),
    Case("megatron-gpus-not-multiple", spec({"trainer": {"backend": "megatron", "tensorParallelSize": 2, "gpus": 3}}),
         "spec.trainer.gpus", "multiple of tensorParallelSize"),
    Case("task-not-a-name", spec({"trainer": {"task": "reverse strings"}}), "spec.trainer.task", "should match"),
    Case("env-name-invalid", spec({"trainer": {"env": [{"name": "1BAD", "value": "x"}]}}), "spec.trainer.env[0].name",
         "should match"),
    Case("watchdog-checks-zero", spec({"watchdog": {"checks": 0}}), "spec.watchdog.checks",
         "greater than or equal to 1"),
    Case("watchdog-checks-fraction", spec({"watchdog": {"checks": 2.5}}), "spec.watchdog.checks",
         "must be of type integer"),
    Case("watchdog-limit-negative", spec({"watchdog": {"limit": -1}}), "spec.watchdog.limit",
         "greater than or equal to 0"),
    Case("watchdog-interval-over-window", spec({"watchdog": {"checkIntervalSeconds": 120}}),
         "spec.watchdog.checkIntervalSeconds", "must not exceed windowSeconds"),
    Case("heat-resume-above-pause", spec({"heatGuard": {"resumeAtC": 90}}), "spec.heatGuard.resumeAtC",
         "resumeAtC must be below pauseAtC"),
    Case("heat-resume-equals-pause", spec({"heatGuard": {"resumeAtC": 84, "pauseAtC": 84}}), "spec.heatGuard.resumeAtC",
         "resumeAtC must be below pauseAtC"),
    Case("heat-min-pause-over-max", spec({"heatGuard": {"minPauseSeconds": 200, "maxPauseSeconds": 100}}),
         "spec.heatGuard.minPauseSeconds", "minPauseSeconds must not exceed maxPauseSeconds"),
    Case("heat-pause-too-hot", spec({"heatGuard": {"pauseAtC": 200}}), "spec.heatGuard.pauseAtC",
         "less than or equal to 150"),
    Case("heat-enabled-no-source", spec({"heatGuard": {"enabled": True, "source": {"type": "none"}}}),
         "spec.heatGuard.source.type", "needs a temperature source"),
    Case("heat-dcgm-no-url", spec({"heatGuard": {"source": {"type": "dcgm"}}}), "spec.heatGuard.source.url",
         "dcgm requires url"),
    Case("rollout-min-ready-over-replicas", spec({"rollout": {"replicas": 2, "minReadyEngines": 3}}),
         "spec.rollout.minReadyEngines", "minReadyEngines must not exceed replicas"),
    Case("rollout-replicas-zero", spec({"rollout": {"replicas": 0}}), "spec.rollout.replicas",
         "greater than or equal to 1"),
    Case("health-threshold-zero", spec({"rollout": {"health": {"failureThreshold": 0}}}),
         "spec.rollout.health.failureThreshold", "greater than or equal to 1"),
    Case("health-timeout-zero", spec({"rollout": {"health": {"timeoutSeconds": 0}}}),
         "spec.rollout.health.timeoutSeconds", "greater than 0"),
    Case("recovery-backoff-base-over-max",
         spec({"rollout": {"recovery": {"backoffBaseSeconds": 100, "backoffMaxSeconds": 10}}}),
         "spec.rollout.recovery.backoffBaseSeconds", "backoffBaseSeconds must not exceed backoffMaxSeconds"),
    Case("engine-device-unknown", spec({"rollout": {"engine": {"device": "tpu"}}}), "spec.rollout.engine.device",
         "Unsupported value"),
    Case("engine-gpus-below-tp", spec({"rollout": {"engine": {"tensorParallelSize": 4, "gpusPerEngine": 2}}}),
         "spec.rollout.engine.gpusPerEngine", "at least tensorParallelSize"),
    Case("engine-port-privileged", spec({"rollout": {"engine": {"port": 80}}}), "spec.rollout.engine.port",
         "greater than or equal to 1024"),
    Case("engine-mem-fraction-one", spec({"rollout": {"engine": {"memFractionStatic": 1.5}}}),
         "spec.rollout.engine.memFractionStatic", "less than 1"),
    Case("weight-sync-mode-unknown", spec({"weightSync": {"mode": "rdma"}}), "spec.weightSync.mode",
         "Unsupported value"),
    Case("weight-sync-nccl-on-cpu", spec({"weightSync": {"mode": "nccl"}, "trainer": {"gpus": 0}}),
         "spec.weightSync.mode", "nccl needs a GPU trainer"),
    Case("weight-sync-pause-in-place", spec({"weightSync": {"pauseMode": "in_place"}}), "spec.weightSync.pauseMode",
         "Unsupported value"),
    Case("weight-sync-keep-zero", spec({"weightSync": {"keepSnapshots": 0}}), "spec.weightSync.keepSnapshots",
         "greater than or equal to 1"),
    Case("snapshot-size-not-quantity", spec({"weightSync": {"snapshotVolume": {"size": "lots"}}}),
         "spec.weightSync.snapshotVolume.size", "should match"),
    Case("snapshot-claim-and-class",
         spec({"weightSync": {"snapshotVolume": {"claimName": "c", "storageClassName": "nfs"}}}),
         "spec.weightSync.snapshotVolume.storageClassName", "applies only to a created claim"),
    Case("eval-fleet-posture-without-fleet", spec({"eval": {"posture": "fleet"}}), "spec.eval.fleet",
         "posture fleet requires a fleet spec", base=BASE_EVAL),
    Case("eval-external-without-class", spec({"eval": {"posture": "external"}}), "spec.eval.external",
         "posture external requires external.classPath", base=BASE_EVAL),
    Case("eval-fleet-with-shared-posture", spec({"eval": {"fleet": {"replicas": 1}}}), "spec.eval.fleet",
         "used only with posture fleet", base=BASE_EVAL),
    Case("eval-no-datasets", spec({"eval": {"datasets": []}}), "spec.eval.datasets", "at least one dataset",
         base=BASE_EVAL),
    Case("eval-duplicate-datasets",
         spec({"eval": {"datasets": [{"name": "a", "task": "reverse"}, {"name": "a", "task": "reverse"}]}}),
         "spec.eval.datasets", "unique", base=BASE_EVAL),
    Case("eval-dataset-path-and-task",
         spec({"eval": {"datasets": [{"name": "a", "task": "reverse", "path": "a.jsonl"}]}}),
         "spec.eval.datasets[0].path", "exactly one of path and task", base=BASE_EVAL),
    Case("eval-max-in-flight-zero", spec({"eval": {"maxInFlight": 0}}), "spec.eval.maxInFlight",
         "greater than or equal to 1", base=BASE_EVAL),
    Case("eval-keep-snapshots-zero", spec({"eval": {"keepSnapshots": 0}}), "spec.eval.keepSnapshots",
         "greater than or equal to 1", base=BASE_EVAL),
    Case("eval-overflow-unknown", spec({"eval": {"overflowPolicy": "drop"}}), "spec.eval.overflowPolicy",
         "Unsupported value", base=BASE_EVAL),
    Case("eval-class-path-invalid", spec({"eval": {"posture": "external", "external": {"classPath": "not a path"}}}),
         "spec.eval.external.classPath", "should match", base=BASE_EVAL),
    Case("eval-fleet-tp-zero", spec({"eval": {"posture": "fleet", "fleet": {"engine": {"tensorParallelSize": 0}}}}),
         "spec.eval.fleet.engine.tensorParallelSize", "greater than or equal to 1", base=BASE_EVAL),
    Case("metrics-port-too-high", spec({"metricsPort": 99999}), "spec.metricsPort", "less than or equal to 65535"),
    Case("checkpoint-interval-missing", spec({"checkpoint": {"keep": 2}}), "spec.checkpoint.intervalSteps",
         "Required value"),
    Case("checkpoint-keep-zero", spec({"checkpoint": {"intervalSteps": 3, "keep": 0}}), "spec.checkpoint.keep",
         "greater than or equal to 1"),
    Case("checkpoint-path-absolute", spec({"checkpoint": {"intervalSteps": 3, "path": "/ckpt"}}),
         "spec.checkpoint.path", "should match"),
    Case("checkpoint-path-escapes", spec({"checkpoint": {"intervalSteps": 3, "path": "a/../../b"}}),
         "spec.checkpoint.path", "stays inside the volume"),
    Case("checkpoint-megatron-gpu", spec({"trainer": {"backend": "megatron", "gpus": 1},
                                          "checkpoint": {"intervalSteps": 3}}),
         "spec.checkpoint", "CPU trainers only"),
    Case("fleet-engine-missing", {"spec": {"engine": DELETE}}, "spec.engine", "Required value", kind="RolloutFleet"),
    Case("fleet-min-ready-over-replicas", {"spec": {"minReadyEngines": 3}}, "spec.minReadyEngines",
         "minReadyEngines must not exceed replicas", kind="RolloutFleet"),
    Case("eval-fleet-model-path-empty", {"spec": {"engine": {"modelPath": ""}}}, "spec.engine.modelPath", "at least 1",
         kind="EvalFleet"),
    Case("eval-fleet-replicas-negative", {"spec": {"replicas": -1}}, "spec.replicas", "greater than or equal to 0",
         kind="EvalFleet"),
]

GOOD_INPUT: list[Case] = [
    Case("minimal", {}, None),
    Case("learning-rate-exponent", spec({"trainer": {"learningRate": 1e-5}}), None),
    Case("external-without-datasets", spec({"eval": {"posture": "external", "datasets": [],
                                                     "external": {"classPath": "my.evals:Judge",
                                                                  "args": {"k": [1, 2]}}}}),
         None, base=BASE_EVAL),
    Case("megatron-tp-pp", spec({"trainer": {"backend": "megatron", "gpus": 8, "tensorParallelSize": 2,
                                             "pipelineParallelSize": 2}}), None),
    Case("cpu-engine-no-gpus", spec({"rollout": {"engine": {"device": "cpu", "gpusPerEngine": 0}}}), None),
    Case("fleet-scaled-to-zero", {"spec": {"replicas": 0}}, None, kind="RolloutFleet"),
    # Boundaries of the cross-field rules: equal values are allowed where the rule says "not exceed".
    Case("heat-min-equals-max-pause", spec({"heatGuard": {"minPauseSeconds": 60, "maxPauseSeconds": 60}}), None),
    Case("watchdog-interval-equals-window", spec({"watchdog": {"checkIntervalSeconds": 60, "windowSeconds": 60}}),
         None),
    Case("backoff-base-equals-max", spec({"rollout": {"recovery": {"backoffBaseSeconds": 5, "backoffMaxSeconds": 5}}}),
         None),
    Case("min-ready-equals-replicas", spec({"rollout": {"replicas": 3, "minReadyEngines": 3}}), None),
    Case("checkpoint-nested-path", spec({"checkpoint": {"intervalSteps": 1, "keep": 3, "path": "ckpt/run-1.a"}}),
         None),
    Case("engine-gpus-equal-tp-times-pp",
         spec({"rollout": {"engine": {"tensorParallelSize": 2, "pipelineParallelSize": 2, "gpusPerEngine": 4}}}),
         None),
]

# Updates of a stored object: (id, change, field path, phrase). Immutable fields are transition rules.
UPDATES = [
    ("model-path-changed", {"modelPath": "tiny://qwen2"}, "spec.modelPath", "immutable"),
    ("backend-changed", {"trainer": {"backend": "megatron"}}, "spec.trainer.backend", "immutable"),
    ("claim-changed", {"weightSync": {"snapshotVolume": {"claimName": "other"}}},
     "spec.weightSync.snapshotVolume.claimName", "immutable"),
    ("claim-removed", {"weightSync": {"snapshotVolume": {"claimName": DELETE}}},
     "spec.weightSync.snapshotVolume.claimName", "immutable"),
    ("steps-changed", {"trainer": {"steps": 500}}, None, ""),
]
UPDATE_BASE = run_manifest("update-base",
                           {"modelPath": "tiny://llama", "weightSync": {"snapshotVolume": {"claimName": "snaps"}}})


@pytest.fixture(scope="module")
def cluster(control_plane):
    """The control plane with the CRDs installed and a namespace for these tests."""
    control_plane.kubectl("apply", "-f", str(REPO / "crds"))
    control_plane.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                          *(f"crd/{k.crd_name}" for k in KINDS))
    control_plane.kubectl("create", "namespace", NAMESPACE, check=False)
    return control_plane


def kubectl_ns(cluster, *args: str, input: str | None = None, check: bool = False):
    return cluster.kubectl("-n", NAMESPACE, *args, input=input, check=check)


def server_dry_run(cluster, manifest: dict):
    return kubectl_ns(cluster, "apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(manifest))


def python_errors(manifest: dict):
    (document,) = load_text(yaml.safe_dump(manifest))
    return document.errors


def test_bad_input_table_is_large_enough():
    assert len(BAD_INPUT) >= 25
    assert len({c.id for c in BAD_INPUT + GOOD_INPUT}) == len(BAD_INPUT) + len(GOOD_INPUT)


@pytest.mark.parametrize("case", BAD_INPUT, ids=lambda c: c.id)
def test_bad_input_rejected_by_api_server_and_loader(cluster, case: Case):
    manifest = case.manifest()
    result = server_dry_run(cluster, manifest)
    assert result.returncode != 0, f"API server accepted {case.id}: {result.stdout}"
    assert case.path in result.stderr, f"API server message does not name {case.path}: {result.stderr}"
    assert case.says.lower() in result.stderr.lower(), f"API server message lacks {case.says!r}: {result.stderr}"

    errors = python_errors(manifest)
    assert errors, f"the loader accepted {case.id}"
    matching = [e for e in errors if e.path == case.path and case.says.lower() in e.message.lower()]
    assert matching, f"the loader did not report {case.path} ({case.says!r}): {[str(e) for e in errors]}"


@pytest.mark.parametrize("case", GOOD_INPUT, ids=lambda c: c.id)
def test_good_input_accepted_by_api_server_and_loader(cluster, case: Case):
    manifest = case.manifest()
    result = server_dry_run(cluster, manifest)
    assert result.returncode == 0, result.stderr
    assert python_errors(manifest) == []


@pytest.mark.parametrize("update", UPDATES, ids=lambda u: u[0])
def test_updates_checked_by_api_server_and_loader(cluster, update):
    name, change, path, says = update
    old = merged(UPDATE_BASE, {"metadata": {"name": f"upd-{name}"}})
    kubectl_ns(cluster, "apply", "-f", "-", input=yaml.safe_dump(old), check=True)
    new = merged(old, {"spec": change})
    result = server_dry_run(cluster, new)
    errors = validate_update(old, new)
    if path is None:
        assert result.returncode == 0, result.stderr
        assert errors == []
        return
    assert result.returncode != 0 and path in result.stderr and says in result.stderr, result.stderr
    assert [e.path for e in errors] == [path] and says in errors[0].message


def test_examples_apply_and_columns_show(cluster):
    applied = kubectl_ns(cluster, "apply", "-f", str(REPO / "examples"), check=True)
    assert "trainingrun.rlfleet.io/quickstart" in applied.stdout
    assert "trainingrun.rlfleet.io/qwen3-4b-grpo" in applied.stdout

    # The fleets a run owns, built by the operator's own builders from the run as the API server
    # stored it (defaults filled in, owned by its uid), are valid objects too.
    names = sorted(doc.obj.metadata.name for path in (REPO / "examples").glob("*.yaml")
                   for doc in load_text(path.read_text()))
    for name in names:
        run = json.loads(kubectl_ns(cluster, "get", "trainingrun", name, "-o", "json", check=True).stdout)
        children = [b.build_rollout_fleet(run)]
        if (eval_fleet := b.build_eval_fleet(run)) is not None:
            children.append(eval_fleet)
        manifest = "---\n".join(yaml.safe_dump(c) for c in children)
        kubectl_ns(cluster, "apply", "-f", "-", input=manifest, check=True)

    listing = kubectl_ns(cluster, "get", "tr,rf,ef", check=True).stdout
    for header in ("PHASE", "STEP", "WEIGHTS", "READY", "LAST EVAL", "AGE", "DESIRED", "PINNED", "RESTARTS"):
        assert header in listing, listing
    assert "rolloutfleet.rlfleet.io/quickstart-rollout" in listing
    assert "evalfleet.rlfleet.io/qwen3-4b-grpo-eval" in listing
    assert "qwen3-4b-grpo-rollout" in kubectl_ns(cluster, "get", "rlfleet", check=True).stdout  # the category


def test_minimal_objects_read_back_with_every_default(cluster):
    for kind, spec_body in (
        ("TrainingRun", {"modelPath": "tiny://llama"}),
        ("RolloutFleet", {"engine": {"modelPath": "/models/tiny"}}),
        ("EvalFleet", {"engine": {"modelPath": "/models/tiny"}}),
    ):
        manifest = fleet_manifest(kind, f"minimal-{kind.lower()}", spec_body)
        kubectl_ns(cluster, "apply", "-f", "-", input=yaml.safe_dump(manifest), check=True)
        stored = json.loads(kubectl_ns(cluster, "get", kind.lower(), manifest["metadata"]["name"], "-o", "json",
                                       check=True).stdout)
        (document,) = load_text(yaml.safe_dump(manifest))
        assert stored["spec"] == wire_dump(document.obj.spec)
    run_spec = json.loads(
        kubectl_ns(cluster, "get", "trainingrun", "minimal-trainingrun", "-o", "json", check=True).stdout)["spec"]
    # Spot checks a user would make: the seed-002 watchdog and heat-guard numbers are there.
    assert run_spec["watchdog"] == {"enabled": True, "windowSeconds": 60, "checkIntervalSeconds": 30, "limit": 100,
                                      "checks": 10}
    assert (run_spec["heatGuard"]["pauseAtC"], run_spec["heatGuard"]["resumeAtC"]) == (84, 74)
    assert run_spec["rollout"]["health"]["failureThreshold"] == 3


def test_status_subresource_feeds_the_columns(cluster):
    manifest = run_manifest("with-status", {"modelPath": "tiny://llama"})
    kubectl_ns(cluster, "apply", "-f", "-", input=yaml.safe_dump(manifest), check=True)
    status = TrainingRunStatus(
        phase="Running", step=12, weight_version="12", ready_engines=1, total_engines=2, reward_mean=0.5,
        engines=[EngineSlotStatus(slot=0, state="Ready", weight_version="12"),
                 EngineSlotStatus(slot=1, state="Dead", restarts=1)],
        conditions=[Condition(type="Degraded", status="True", reason="EngineDead", message="slot 1: probe timeout",
                              last_transition_time="2026-01-01T00:00:00Z")],
        last_eval=LastEvalStatus(step=10, scores={"reverse": 0.25}, skipped={"busy": 1}),
    )
    kubectl_ns(cluster, "patch", "trainingrun", "with-status", "--subresource=status", "--type=merge",
               "-p", json.dumps({"status": wire_dump(status)}), check=True)
    row = kubectl_ns(cluster, "get", "tr", "with-status", "--no-headers", check=True).stdout.split()
    assert row[:5] == ["with-status", "Running", "12", "12", "1/2"], row
    assert "@10 reverse=0.25" in " ".join(row)
    stored = json.loads(kubectl_ns(cluster, "get", "tr", "with-status", "-o", "json", check=True).stdout)
    assert TrainingRun.model_validate(stored).status == status


def test_fleet_scale_subresource(cluster):
    manifest = fleet_manifest("RolloutFleet", "scaled", BASE_FLEET)
    kubectl_ns(cluster, "apply", "-f", "-", input=yaml.safe_dump(manifest), check=True)
    kubectl_ns(cluster, "patch", "rolloutfleet", "scaled", "--subresource=status", "--type=merge", "-p",
               json.dumps({"status": {"replicas": 2, "readyReplicas": 2, "selector": "rlfleet.io/fleet=scaled"}}),
               check=True)
    kubectl_ns(cluster, "scale", "rf", "scaled", "--replicas=4", check=True)
    scale = json.loads(kubectl_ns(cluster, "get", "rf", "scaled", "--subresource=scale", "-o", "json",
                                  check=True).stdout)
    assert scale["spec"]["replicas"] == 4
    assert scale["status"] == {"replicas": 2, "selector": "rlfleet.io/fleet=scaled"}
    kubectl_ns(cluster, "scale", "rf", "scaled", "--replicas=0", check=True)  # switched off despite minReadyEngines


def test_kubectl_explain_shows_field_docs(cluster):
    heat = cluster.kubectl("explain", "trainingrun.spec.heatGuard").stdout
    assert "Pause generation on an engine whose GPU runs hot" in heat
    for name in ("pauseAtC", "resumeAtC", "minPauseSeconds", "maxPauseSeconds", "source"):
        assert name in heat
    assert "Default: 84.0." in cluster.kubectl("explain", "trainingrun.spec.heatGuard.pauseAtC").stdout
    overrides = cluster.kubectl("explain", "trainingrun.spec.eval.fleet.engine.tensorParallelSize").stdout
    assert "rollout engine" in overrides
    assert "Unsupported" not in cluster.kubectl("explain", "rolloutfleet.status.engines.lastFailure").stdout
