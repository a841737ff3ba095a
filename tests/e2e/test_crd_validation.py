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
    Case("model-path-tiny-unknown", spec({"modelPath": "tiny://gpt2"}), "spec.modelPath",
         "tiny://llama, tiny://qwen2 or tiny://qwen3"),
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
         "spec.trainer.gpus", "must equal tensorParallelSize x pipelineParallelSize x dataParallelSize"),
    Case("more-gpus-than-ranks", spec({"trainer": {"backend": "megatron", "tensorParallelSize": 2, "gpus": 4}}),
         "spec.trainer.gpus", "gpus x nodes"),
    Case("fewer-gpus-than-ranks", spec({"trainer": {"dataParallelSize": 4, "gpus": 2}}),
         "spec.trainer.gpus", "one rank per GPU"),
    Case("data-parallel-wider-than-the-batch", spec({"trainer": {"gpus": 0, "dataParallelSize": 8,
                                                                 "promptsPerStep": 1, "samplesPerPrompt": 4}}),
         "spec.trainer.dataParallelSize", "must be at least dataParallelSize"),
    Case("trainer-group-uneven-on-cpu", spec({"trainer": {"nodes": 2, "gpus": 0, "dataParallelSize": 3}}),
         "spec.trainer.nodes", "must be a multiple of nodes"),
    Case("trainer-group-metrics-on-rendezvous", spec({"metricsPort": 29500,
                                                      "trainer": {"nodes": 2, "gpus": 0, "dataParallelSize": 2}}),
         "spec.metricsPort", "rendezvous port"),
    Case("fsdp-on-megatron", spec({"trainer": {"backend": "megatron", "gpus": 2, "dataParallelSize": 2,
                                               "dataParallelMode": "fsdp"}}),
         "spec.trainer.dataParallelMode", "needs backend torch and dataParallelSize above 1"),
    Case("fsdp-of-one-replica", spec({"trainer": {"gpus": 1, "dataParallelMode": "fsdp"}}),
         "spec.trainer.dataParallelMode", "needs backend torch and dataParallelSize above 1"),
    Case("data-parallel-mode-unknown", spec({"trainer": {"dataParallelMode": "zero3"}}),
         "spec.trainer.dataParallelMode", "Unsupported value"),
    Case("trainer-dp-zero", spec({"trainer": {"dataParallelSize": 0}}),
         "spec.trainer.dataParallelSize", "greater than or equal to 1"),
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
         "dcgm and prometheus require url"),
    Case("heat-prometheus-no-url", spec({"heatGuard": {"source": {"type": "prometheus"}}}),
         "spec.heatGuard.source.url", "dcgm and prometheus require url"),
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
    Case("engine-gpus-on-cpu", spec({"rollout": {"engine": {"device": "cpu", "gpusPerEngine": 2}}}),
         "spec.rollout.engine.gpusPerEngine", "a cpu engine uses none"),
    Case("engine-port-privileged", spec({"rollout": {"engine": {"port": 80}}}), "spec.rollout.engine.port",
         "greater than or equal to 1024"),
    Case("engine-mem-fraction-one", spec({"rollout": {"engine": {"memFractionStatic": 1.5}}}),
         "spec.rollout.engine.memFractionStatic", "less than 1"),
    Case("weight-sync-mode-unknown", spec({"weightSync": {"mode": "rdma"}}), "spec.weightSync.mode",
         "Unsupported value"),
    Case("weight-sync-nccl-gone", spec({"weightSync": {"mode": "nccl"}}), "spec.weightSync.mode",
         "Unsupported value"),
    Case("weight-sync-broadcast-mixed-devices",
         spec({"weightSync": {"mode": "broadcast"}, "trainer": {"gpus": 0}, "rollout": {"engine": {"device": "cuda"}}}),
         "spec.weightSync.mode", "same kind of device"),
    Case("broadcast-engine-pipeline-stages",
         spec({"weightSync": {"mode": "broadcast"},
               "rollout": {"engine": {"pipelineParallelSize": 2, "gpusPerEngine": 2}}}),
         "spec.rollout.engine.pipelineParallelSize", "cannot reach an engine of several pipeline stages"),
    Case("broadcast-engine-data-parallel",
         spec({"weightSync": {"mode": "broadcast"},
               "rollout": {"engine": {"dataParallelSize": 2, "gpusPerEngine": 2}}}),
         "spec.rollout.engine.dataParallelSize", "cannot reach an engine of several data-parallel replicas"),
    Case("weight-sync-broadcast-metrics-port-clash",
         spec({"weightSync": {"mode": "broadcast"}, "metricsPort": 29600}), "spec.metricsPort", "update-group port"),
    Case("weight-sync-bucket-zero", spec({"weightSync": {"bucketMegabytes": 0}}), "spec.weightSync.bucketMegabytes",
         "greater than or equal to 1"),
    Case("weight-sync-disk-verify-unknown", spec({"weightSync": {"diskVerify": "some"}}),
         "spec.weightSync.diskVerify", "Unsupported value"),
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
    # Accepted only where they take effect (elsewhere they would be silently ignored).
    Case("eval-shared-keep-snapshots", spec({"eval": {"keepSnapshots": 5}}), "spec.eval.keepSnapshots",
         "posture shared evaluates the live weights", base=BASE_EVAL),
    Case("eval-shared-pin-retries", spec({"eval": {"pinRetries": 4}}), "spec.eval.pinRetries",
         "read with posture fleet only", base=BASE_EVAL),
    Case("eval-task-input-key", spec({"eval": {"datasets": [{"name": "a", "task": "reverse", "inputKey": "q"}]}}),
         "spec.eval.datasets[0].inputKey", "a task makes its own prompts", base=BASE_EVAL),
    Case("weight-sync-disk-no-fallback", spec({"weightSync": {"fallbackToDisk": False}}),
         "spec.weightSync.fallbackToDisk", "mode disk has no broadcast"),
    Case("weight-sync-disk-buckets", spec({"weightSync": {"bucketMegabytes": 64}}),
         "spec.weightSync.bucketMegabytes", "mode disk sends none"),
    Case("heat-file-source-with-url",
         spec({"heatGuard": {"source": {"type": "file", "path": "/t", "url": "http://dcgm:9400/metrics"}}}),
         "spec.heatGuard.source.url", "read by source types dcgm and prometheus only"),
    Case("snapshot-claim-with-size", spec({"weightSync": {"snapshotVolume": {"claimName": "c", "size": "1Ti"}}}),
         "spec.weightSync.snapshotVolume.size", "an existing claim (claimName) keeps its own"),
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
    Case("fleet-engine-missing", {"spec": {"engine": DELETE}}, "spec.engine", "Required value", kind="RolloutFleet"),
    Case("fleet-min-ready-over-replicas", {"spec": {"minReadyEngines": 3}}, "spec.minReadyEngines",
         "minReadyEngines must not exceed replicas", kind="RolloutFleet"),
    Case("fleet-of-no-run-first-wait", {"spec": {"health": {"firstWaitSeconds": 5}}}, "spec.health.firstWaitSeconds",
         "a fleet of no run (no runName) is never paused", kind="RolloutFleet"),
    Case("fleet-of-no-run-router-restarts", {"spec": {"router": {"maxRestarts": 9}}}, "spec.router.maxRestarts",
         "restarted by Kubernetes", kind="RolloutFleet"),
    Case("fleet-of-no-run-wait-all-alive", {"spec": {"recovery": {"waitAllAliveTimeoutSeconds": 60}}},
         "spec.recovery.waitAllAliveTimeoutSeconds", "has no weight sync", kind="EvalFleet"),
    Case("eval-fleet-model-path-empty", {"spec": {"engine": {"modelPath": ""}}}, "spec.engine.modelPath", "at least 1",
         kind="EvalFleet"),
    Case("eval-fleet-replicas-negative", {"spec": {"replicas": -1}}, "spec.replicas", "greater than or equal to 0",
         kind="EvalFleet"),
    # Names derived from metadata.name / runName: Services need a letter first, labels 63 characters.
    Case("run-name-leading-digit", {"metadata": {"name": "1run"}}, "metadata.name", "should match"),
    Case("fleet-name-too-long", {"metadata": {"name": "f" * 57}}, "metadata.name", "56", kind="RolloutFleet"),
    Case("fleet-name-leading-digit", {"metadata": {"name": "9fleet"}}, "metadata.name", "should match",
         kind="EvalFleet"),
    Case("fleet-run-name-invalid", {"spec": {"runName": "Run_1"}}, "spec.runName", "should match",
         kind="RolloutFleet"),
    # Managed flags in extraArgs (the command builder's own, aliases and abbreviations included).
    Case("extra-args-port", spec({"rollout": {"engine": {"extraArgs": ["--port", "31000"]}}}),
         "spec.rollout.engine.extraArgs[0]", "must not set (or abbreviate) a flag rlfleet manages"),
    Case("extra-args-model-alias", spec({"rollout": {"engine": {"extraArgs": ["--trust-remote-code", "--model=/x"]}}}),
         "spec.rollout.engine.extraArgs[1]", "must not set (or abbreviate) a flag rlfleet manages"),
    Case("extra-args-api-key", spec({"rollout": {"engine": {"extraArgs": ["--api-key", "k"]}}}),
         "spec.rollout.engine.extraArgs[0]", "flag rlfleet manages"),
    Case("extra-args-abbreviated-host", spec({"rollout": {"engine": {"extraArgs": ["--ho=0.0.0.0"]}}}),
         "spec.rollout.engine.extraArgs[0]", "flag rlfleet manages"),
    Case("extra-args-eval-override", spec({"eval": {"posture": "fleet", "fleet": {
        "engine": {"extraArgs": ["--tensor-parallel-size=2"]}}}}),
         "spec.eval.fleet.engine.extraArgs[0]", "flag rlfleet manages", base=BASE_EVAL),
    Case("extra-args-fleet-tp", {"spec": {"engine": {"modelPath": "/m", "extraArgs": ["--tp-size", "2"]}}},
         "spec.engine.extraArgs[0]", "flag rlfleet manages", kind="RolloutFleet"),
    # Reserved environment names and env sources.
    Case("env-reserved-rlfleet", spec({"trainer": {"env": [{"name": "RLFLEET_SNAPSHOT_DIR", "value": "/x"}]}}),
         "spec.trainer.env[0].name", "is reserved"),
    Case("env-reserved-pod-ip", spec({"rollout": {"engine": {"env": [{"name": "A", "value": "1"},
                                                                     {"name": "POD_IP", "value": "0.0.0.0"}]}}}),
         "spec.rollout.engine.env[1].name", "is reserved"),
    Case("env-value-and-value-from", spec({"trainer": {"env": [
        {"name": "T", "value": "x", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}}),
         "spec.trainer.env[0].value", "exactly one of value and valueFrom"),
    Case("env-neither-value-nor-value-from", spec({"trainer": {"env": [{"name": "T"}]}}),
         "spec.trainer.env[0].value", "exactly one of value and valueFrom"),
    Case("env-value-from-two-sources", spec({"rollout": {"engine": {"env": [{"name": "T", "valueFrom": {
        "secretKeyRef": {"name": "s", "key": "k"}, "configMapKeyRef": {"name": "c", "key": "k"}}}]}}}),
         "spec.rollout.engine.env[0].valueFrom", "exactly one of secretKeyRef and configMapKeyRef"),
    Case("env-secret-name-invalid", spec({"trainer": {"env": [
        {"name": "T", "valueFrom": {"secretKeyRef": {"name": "My_Secret", "key": "k"}}}]}}),
         "spec.trainer.env[0].valueFrom.secretKeyRef.name", "should match"),
    Case("env-config-key-invalid", spec({"trainer": {"env": [
        {"name": "T", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "a/b"}}}]}}),
         "spec.trainer.env[0].valueFrom.configMapKeyRef.key", "should match"),
    # Resources: names, quantities, requests <= limits, GPUs only from the GPU fields.
    Case("resources-quantity-invalid", spec({"trainer": {"resources": {"requests": {"cpu": "lots"}}}}),
         "spec.trainer.resources.requests.cpu", "should match"),
    Case("resources-request-over-limit", spec({"rollout": {"engine": {"resources": {
        "requests": {"memory": "8Gi"}, "limits": {"memory": "4Gi"}}}}}),
         "spec.rollout.engine.resources.requests", "must not exceed its limit"),
    Case("resources-name-invalid", spec({"trainer": {"resources": {"limits": {"CPU": "2"}}}}),
         "spec.trainer.resources", "resource names are"),
    Case("resources-gpu-named", spec({"rollout": {"engine": {"resources": {"limits": {"nvidia.com/gpu": "2"}}}}}),
         "spec.rollout.engine.resources", "is set from gpus"),
    Case("resources-extended-without-limit", spec({"trainer": {"resources": {"requests": {"example.com/fpga": "1"}}}}),
         "spec.trainer.resources.requests", "extended resource"),
    # Scheduling: node selector keys and values, tolerations.
    Case("node-selector-key-invalid", spec({"trainer": {"nodeSelector": {"gpu type": "a100"}}}),
         "spec.trainer.nodeSelector", "label keys"),
    Case("eval-override-node-selector-key", spec({"eval": {"posture": "fleet", "fleet": {
        "engine": {"nodeSelector": {"-gpu": "h100"}}}}}), "spec.eval.fleet.engine.nodeSelector", "label keys",
         base=BASE_EVAL),
    Case("node-selector-value-invalid", spec({"rollout": {"engine": {"nodeSelector": {"pool": "a100 x8"}}}}),
         "spec.rollout.engine.nodeSelector.pool", "should match"),
    Case("toleration-exists-with-value", spec({"trainer": {"tolerations": [
        {"key": "gpu", "operator": "Exists", "value": "true"}]}}),
         "spec.trainer.tolerations[0].value", "takes no value"),
    Case("toleration-no-key-equal", spec({"rollout": {"engine": {"tolerations": [{"value": "x"}]}}}),
         "spec.rollout.engine.tolerations[0].operator", "must have operator Exists"),
    Case("toleration-key-invalid", spec({"trainer": {"tolerations": [{"key": "bad key", "operator": "Exists"}]}}),
         "spec.trainer.tolerations[0].key", "should match"),
    Case("eps-clip-one", spec({"trainer": {"epsClip": 1}}), "spec.trainer.epsClip", "less than 1"),
    Case("engine-model-path-not-the-runs", spec({"rollout": {"engine": {"modelPath": "/models/other"}}}),
         "spec.rollout.engine.modelPath", "leave rollout.engine.modelPath unset"),
    Case("engine-data-parallel-without-its-gpus", spec({"rollout": {"engine": {"device": "cuda",
                                                                                "dataParallelSize": 2}}}),
         "spec.rollout.engine.gpusPerEngine", "x dataParallelSize"),
    Case("heat-guard-nvml-on-cpu-engines", spec({"heatGuard": {"enabled": True},
                                                 "rollout": {"engine": {"device": "cpu"}}}),
         "spec.heatGuard.source.type", "nvml, dcgm and prometheus read the engines' GPU temperatures"),
    Case("heat-guard-prometheus-on-cpu-engines", spec({"heatGuard": {"enabled": True, "source": {
        "type": "prometheus", "url": "http://prometheus.monitoring:9090"}}, "rollout": {"engine": {"device": "cpu"}}}),
         "spec.heatGuard.source.type", "must be cuda"),
    Case("checkpoint-path-on-a-weight-snapshot", spec({"checkpoint": {"intervalSteps": 1, "path": "step_3/ckpt"}}),
         "spec.checkpoint.path", "choose another directory"),
    Case("watchdog-retrip-shorter-than-a-trip", spec({"watchdog": {"retripPeriodSeconds": 5}}),
         "spec.watchdog.retripPeriodSeconds", "at least checks x checkIntervalSeconds"),
    # Images.
    Case("engine-image-invalid", spec({"rollout": {"engine": {"image": "SGLang latest"}}}),
         "spec.rollout.engine.image", "should match"),
    Case("trainer-image-invalid", spec({"trainer": {"image": "rlfleet/rlfleet:"}}), "spec.trainer.image",
         "should match"),
    Case("router-image-invalid", spec({"rollout": {"router": {"image": " lmsysorg/sglang"}}}),
         "spec.rollout.router.image", "should match"),
    # Ports that collide with managed ones.
    Case("router-port-is-metrics-port", spec({"rollout": {"router": {"port": 29000}}}), "spec.rollout.router.port",
         "are taken in the router pod"),
    Case("router-port-is-follower-health-port", spec({"rollout": {"router": {"port": 29001}}}),
         "spec.rollout.router.port", "its engine follower's health"),
    # Mount paths, claims, storage classes, sizes.
    Case("mount-path-relative", spec({"weightSync": {"mountPath": "snapshots"}}), "spec.weightSync.mountPath",
         "should match"),
    Case("mount-path-root", spec({"weightSync": {"mountPath": "/"}}), "spec.weightSync.mountPath", "should match"),
    Case("mount-path-dot-dot", spec({"weightSync": {"mountPath": "/data/../etc"}}), "spec.weightSync.mountPath",
         "must not contain '..'"),
    Case("mount-path-dev-shm", spec({"weightSync": {"mountPath": "/dev/shm"}}), "spec.weightSync.mountPath",
         "/dev/shm"),
    Case("fleet-mount-path-dev-shm", {"spec": {"snapshots": {"claimName": "c", "mountPath": "/dev/shm/s"}}},
         "spec.snapshots.mountPath", "/dev/shm", kind="RolloutFleet"),
    Case("claim-name-invalid", spec({"weightSync": {"snapshotVolume": {"claimName": "My_Claim"}}}),
         "spec.weightSync.snapshotVolume.claimName", "should match"),
    Case("fleet-claim-name-invalid", {"spec": {"snapshots": {"claimName": "snap shots"}}}, "spec.snapshots.claimName",
         "should match", kind="EvalFleet"),
    Case("storage-class-invalid", spec({"weightSync": {"snapshotVolume": {"storageClassName": "Fast SSD"}}}),
         "spec.weightSync.snapshotVolume.storageClassName", "should match"),
    Case("snapshot-size-zero", spec({"weightSync": {"snapshotVolume": {"size": "0Gi"}}}),
         "spec.weightSync.snapshotVolume.size", "greater than 0"),
    # URLs, absurd products, names that do not resolve.
    Case("heat-dcgm-url-without-scheme", spec({"heatGuard": {"source": {"type": "dcgm", "url": "dcgm:9400/metrics"}}}),
         "spec.heatGuard.source.url", "should match"),
    Case("prompts-times-samples-absurd", spec({"trainer": {"promptsPerStep": 1_000_000, "samplesPerPrompt": 8}}),
         "spec.trainer.promptsPerStep", "must not exceed 1,000,000 samples per step"),
    Case("task-unknown", spec({"trainer": {"task": "revers"}}), "spec.trainer.task", "should match"),
    Case("eval-task-unknown", spec({"eval": {"datasets": [{"name": "a", "task": "reverse2"}]}}),
         "spec.eval.datasets[0].task", "should match", base=BASE_EVAL),
]

GOOD_INPUT: list[Case] = [
    Case("minimal", {}, None),
    Case("learning-rate-exponent", spec({"trainer": {"learningRate": 1e-5}}), None),
    Case("external-without-datasets", spec({"eval": {"posture": "external", "datasets": [],
                                                     "external": {"classPath": "my.evals:Judge",
                                                                  "args": {"k": [1, 2]}}}}),
         None, base=BASE_EVAL),
    Case("megatron-tp-dp", spec({"trainer": {"backend": "megatron", "gpus": 8, "tensorParallelSize": 2,
                                             "dataParallelSize": 4}}), None),
    Case("megatron-cpu-ranks", spec({"trainer": {"backend": "megatron", "gpus": 0, "tensorParallelSize": 2,
                                                 "dataParallelSize": 2}}), None),
    Case("torch-data-parallel", spec({"trainer": {"gpus": 2, "dataParallelSize": 2}}), None),
    Case("megatron-cpu-pipeline", spec({"trainer": {"backend": "megatron", "gpus": 0, "pipelineParallelSize": 2,
                                                    "tensorParallelSize": 2}}), None),
    Case("cpu-engine-no-gpus", spec({"rollout": {"engine": {"device": "cpu", "gpusPerEngine": 0}}}), None),
    Case("fleet-scaled-to-zero", {"spec": {"replicas": 0}}, None, kind="RolloutFleet"),
    # Boundaries of the cross-field rules: equal values are allowed where the rule says "not exceed".
    Case("heat-min-equals-max-pause", spec({"heatGuard": {"minPauseSeconds": 60, "maxPauseSeconds": 60}}), None),
    Case("heat-prometheus-cuda-engines", spec({"heatGuard": {"enabled": True, "source": {
        "type": "prometheus", "url": "http://prometheus.monitoring:9090"}},
        "rollout": {"engine": {"device": "cuda", "gpusPerEngine": 1}}}), None),
    Case("watchdog-interval-equals-window", spec({"watchdog": {"checkIntervalSeconds": 60, "windowSeconds": 60}}),
         None),
    Case("backoff-base-equals-max", spec({"rollout": {"recovery": {"backoffBaseSeconds": 5, "backoffMaxSeconds": 5}}}),
         None),
    Case("broadcast-buckets-no-fallback", spec({"weightSync": {"mode": "broadcast", "bucketMegabytes": 64,
                                                               "fallbackToDisk": False}}), None),
    Case("eval-fleet-pin-bounds", spec({"eval": {"posture": "fleet", "fleet": {"replicas": 1}, "pinRetries": 4,
                                                 "pinTimeoutSeconds": 60, "keepSnapshots": 3}}), None, base=BASE_EVAL),
    Case("eval-file-keys", spec({"eval": {"datasets": [{"name": "a", "path": "a.jsonl", "inputKey": "q",
                                                        "labelKey": "a"}]}}), None, base=BASE_EVAL),
    Case("broadcast-engine-dp-attention",
         spec({"weightSync": {"mode": "broadcast"},
               "rollout": {"engine": {"dataParallelSize": 2, "tensorParallelSize": 2, "gpusPerEngine": 2,
                                      "extraArgs": ["--enable-dp-attention"]}}}), None),
    Case("min-ready-equals-replicas", spec({"rollout": {"replicas": 3, "minReadyEngines": 3}}), None),
    Case("checkpoint-nested-path", spec({"checkpoint": {"intervalSteps": 1, "keep": 3, "path": "ckpt/run-1.a"}}),
         None),
    Case("engine-gpus-equal-tp-times-pp",
         spec({"rollout": {"engine": {"tensorParallelSize": 2, "pipelineParallelSize": 2, "gpusPerEngine": 4}}}),
         None),
    Case("env-from-secret-and-config-map", spec({
        "trainer": {"env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
                            {"name": "EMPTY", "value": ""}]},
        "rollout": {"engine": {"env": [{"name": "CFG", "valueFrom": {
            "configMapKeyRef": {"name": "engine-config", "key": "a.json", "optional": True}}}]}}}), None),
    Case("extra-args-not-managed", spec({"rollout": {"engine": {"device": "cpu", "extraArgs": [
        "--dtype", "bfloat16", "--chunked-prefill-size=512", "--trust-remote-code"]}}}), None),
    Case("resources-and-scheduling", spec({
        "trainer": {"resources": {"requests": {"cpu": "500m", "memory": "1Gi", "example.com/fpga": "1"},
                                  "limits": {"cpu": "2", "memory": "1Gi", "example.com/fpga": "1"}},
                    "nodeSelector": {"kubernetes.io/arch": "amd64", "pool": ""},
                    "tolerations": [{"operator": "Exists"}, {"key": "gpu", "value": "a100", "effect": "NoSchedule"}]},
        "rollout": {"engine": {"image": "registry.example.com:5000/team/sglang:v0.5.23-cu12",
                               "nodeSelector": {"example.com/gpu-class": "h100"}}}}), None),
    Case("integral-floats", spec({"watchdog": {"checks": 10.0}, "rollout": {"replicas": 2.0}}), None),
    Case("custom-mount-claim-class", spec({"weightSync": {"mountPath": "/data/snapshots", "snapshotVolume": {
        "size": "1.5Gi", "storageClassName": "nfs.csi.example.com"}},
        "trainer": {"task": "my_tasks.words:Reverse", "promptsPerStep": 1000, "samplesPerPrompt": 1000}}), None),
    Case("fleet-of-a-run-waits", {"spec": {"runName": "r1", "health": {"firstWaitSeconds": 5},
                                           "recovery": {"waitAllAliveTimeoutSeconds": 60},
                                           "router": {"maxRestarts": 9}}}, None, kind="RolloutFleet"),
    Case("fleet-with-run-and-snapshots", {"spec": {"runName": "r1", "snapshots": {"claimName": "r1-snapshots"},
                                                   "router": {"port": 31000}}}, None, kind="RolloutFleet"),
    Case("fleet-name-at-limit", {"metadata": {"name": "f" * 56}}, None, kind="EvalFleet"),
    Case("megatron-gpus-pipeline-checkpoints", spec({"trainer": {
        "backend": "megatron", "gpus": 4, "tensorParallelSize": 2, "pipelineParallelSize": 2},
        "checkpoint": {"intervalSteps": 3}}), None),
    Case("torch-fsdp-replicas", spec({"trainer": {"gpus": 0, "dataParallelSize": 2, "dataParallelMode": "fsdp"}}),
         None),
    Case("engine-model-path-the-runs", spec({"rollout": {"engine": {"modelPath": "tiny://llama?seed=0"}}}), None),
    Case("engine-data-parallel-attention", spec({"rollout": {"engine": {
        "device": "cuda", "tensorParallelSize": 2, "dataParallelSize": 2, "gpusPerEngine": 2,
        "extraArgs": ["--enable-dp-attention"]}}}), None),
    Case("watchdog-retrip-one-trip-long", spec({"watchdog": {"checks": 3, "checkIntervalSeconds": 10,
                                                             "retripPeriodSeconds": 30}}), None),
]

# Updates of a stored object: (id, change, field path, phrase). Immutable fields are transition rules.
UPDATES = [
    ("model-path-changed", {"modelPath": "tiny://qwen2"}, "spec.modelPath", "immutable"),
    ("backend-changed", {"trainer": {"backend": "megatron"}}, "spec.trainer.backend", "immutable"),
    ("claim-changed", {"weightSync": {"snapshotVolume": {"claimName": "other"}}}, "spec.weightSync", "fixed"),
    ("claim-removed", {"weightSync": {"snapshotVolume": {"claimName": DELETE}}}, "spec.weightSync", "fixed"),
    ("mount-path-changed", {"weightSync": {"mountPath": "/elsewhere"}}, "spec.weightSync", "fixed"),
    ("volume-local-path-changed", {"weightSync": {"snapshotVolume": {"localPath": "/elsewhere"}}}, "spec.weightSync",
     "fixed"),
    # What the trainer pods and the orchestrator read when they start is fixed: a live edit would reach
    # them only at a recreation.
    ("steps-changed", {"trainer": {"steps": 500}}, "spec.trainer", "fixed once the run exists"),
    ("trainer-image-changed", {"trainer": {"image": "example.com/other:1"}}, "spec.trainer", "all but maxRestarts"),
    ("rollout-engine-changed", {"rollout": {"engine": {"extraArgs": ["--chunked-prefill-size", "512"]}}},
     "spec.rollout", "all but replicas and minReadyEngines"),
    ("rollout-retries-changed", {"rollout": {"maxRetries": 5}}, "spec.rollout", "fixed once the run exists"),
    # The rollout fleet may be scaled while the run runs: the operator scales its RolloutFleet, the
    # trainer's orchestrator follows the fleet.
    ("rollout-scaled", {"rollout": {"replicas": 3, "minReadyEngines": 2}}, None, ""),
    ("rollout-scaled-below-its-minimum", {"rollout": {"replicas": 1, "minReadyEngines": 2}},
     "spec.rollout.minReadyEngines", "must not exceed replicas"),
    ("weight-sync-mode-changed", {"weightSync": {"mode": "broadcast"}}, "spec.weightSync", "fixed"),
    ("watchdog-changed", {"watchdog": {"checks": 7}}, "spec.watchdog", "fixed"),
    ("heat-guard-changed", {"heatGuard": {"pauseAtC": 80}}, "spec.heatGuard", "fixed"),
    ("eval-added", {"eval": {"datasets": [{"name": "a", "task": "reverse"}]}}, "spec.eval", "fixed"),
    ("checkpoint-added", {"checkpoint": {"intervalSteps": 2}}, "spec.checkpoint", "fixed"),
    ("tracking-added", {"tracking": {"tensorboard": {}}}, "spec.tracking", "fixed"),
    ("metrics-port-changed", {"metricsPort": 9500}, "spec.metricsPort", "fixed"),
    # The operator reads the trainer's restart budget at every reconcile: it may change.
    ("max-restarts-changed", {"trainer": {"maxRestarts": 7}}, None, ""),
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
    assert "rolloutfleet.rlfleet.io/tiny-serve" in applied.stdout  # a fleet of no run

    # The fleets a run owns, built by the operator's own builders from the run as the API server
    # stored it (defaults filled in, owned by its uid), are valid objects too.
    names = sorted(doc.obj.metadata.name for path in (REPO / "examples").glob("*.yaml")
                   for doc in load_text(path.read_text()) if doc.data["kind"] == "TrainingRun")
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


def test_run_scale_subresource_scales_its_rollout_fleet(cluster):
    """`kubectl scale tr` sets the run's spec.rollout.replicas (a running run follows it), within the same
    rules as an edit: at least 1, not below minReadyEngines."""
    manifest = run_manifest("scaled-run", {"modelPath": "tiny://llama", "rollout": {"replicas": 2,
                                                                                  "minReadyEngines": 2}})
    kubectl_ns(cluster, "apply", "-f", "-", input=yaml.safe_dump(manifest), check=True)
    selector = "app.kubernetes.io/component=engine,rlfleet.io/fleet=scaled-run-rollout"
    kubectl_ns(cluster, "patch", "trainingrun", "scaled-run", "--subresource=status", "--type=merge", "-p",
               json.dumps({"status": {"rolloutReplicas": 2, "rolloutSelector": selector}}), check=True)
    kubectl_ns(cluster, "scale", "tr", "scaled-run", "--replicas=5", check=True)
    stored = json.loads(kubectl_ns(cluster, "get", "tr", "scaled-run", "-o", "json", check=True).stdout)
    assert stored["spec"]["rollout"]["replicas"] == 5 and stored["spec"]["rollout"]["minReadyEngines"] == 2
    scale = json.loads(kubectl_ns(cluster, "get", "tr", "scaled-run", "--subresource=scale", "-o", "json",
                                  check=True).stdout)
    assert scale["spec"]["replicas"] == 5 and scale["status"] == {"replicas": 2, "selector": selector}
    below = kubectl_ns(cluster, "scale", "tr", "scaled-run", "--replicas=1")
    assert below.returncode != 0 and "minReadyEngines must not exceed replicas" in below.stderr, below.stderr
    zero = kubectl_ns(cluster, "scale", "tr", "scaled-run", "--replicas=0")
    assert zero.returncode != 0 and "spec.rollout.replicas" in zero.stderr, zero.stderr


def test_kubectl_explain_shows_field_docs(cluster):
    heat = cluster.kubectl("explain", "trainingrun.spec.heatGuard").stdout
    assert "Pause generation on a rollout engine whose GPU runs hot" in heat
    for name in ("pauseAtC", "resumeAtC", "minPauseSeconds", "maxPauseSeconds", "source"):
        assert name in heat
    assert "Default: 84.0." in cluster.kubectl("explain", "trainingrun.spec.heatGuard.pauseAtC").stdout
    overrides = cluster.kubectl("explain", "trainingrun.spec.eval.fleet.engine.tensorParallelSize").stdout
    assert "rollout engine" in overrides
    assert "Unsupported" not in cluster.kubectl("explain", "rolloutfleet.status.engines.lastFailure").stdout


CHILDREN_NAMESPACE = "crd-children"


def _dry_run_json(cluster, manifest: dict) -> dict:
    """The object as the API server would store it (defaults filled, a uid), created with dryRun=All."""
    result = cluster.kubectl("-n", CHILDREN_NAMESPACE, "create", "--dry-run=server", "-o", "json", "-f", "-",
                             input=yaml.safe_dump(manifest), check=False)
    assert result.returncode == 0, f"{manifest['kind']}/{manifest['metadata']['name']}: {result.stderr}"
    return json.loads(result.stdout)


def _fleet_children(fleet: dict) -> list[dict]:
    spec = b.fleet_spec(fleet)
    pods = [b.build_engine_pod(fleet, slot, spec=spec) for slot in range(max(1, min(spec.replicas, 2)))]
    return [*pods, b.build_router_deployment(fleet, spec), b.build_router_service(fleet, spec),
            b.build_engine_network_policy(fleet, spec=spec)]


def _check_children(cluster, label: str, children: list[dict]) -> None:
    for child in children:
        result = cluster.kubectl("-n", CHILDREN_NAMESPACE, "create", "--dry-run=server", "-f", "-",
                                 input=yaml.safe_dump(child), check=False)
        assert result.returncode == 0, (
            f"{label}: the API server refuses the operator's {child['kind']}/{child['metadata']['name']}: "
            f"{result.stderr}")


def _good_manifests() -> list[tuple[str, dict]]:
    found = [(f"table:{c.id}", c.manifest()) for c in GOOD_INPUT]
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for doc in load_text(path.read_text()):
            found.append((f"{path.name}:{doc.label}", doc.data))
    return found


@pytest.fixture(scope="module")
def children_namespace(cluster):
    cluster.kubectl("create", "namespace", CHILDREN_NAMESPACE, check=False)
    cluster.kubectl("-n", CHILDREN_NAMESPACE, "create", "serviceaccount", "rlfleet-trainer", check=False)
    return cluster


@pytest.mark.parametrize("label, manifest", _good_manifests(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_api_server_admits_every_child_the_operator_builds(children_namespace, label, manifest):
    """For every valid manifest of the table and every example: the objects the operator's own builders
    make from it (as the API server stores it) pass the API server's validation and admission (dryRun=All)."""
    cluster = children_namespace
    assert python_errors(manifest) == [], label
    stored = _dry_run_json(cluster, {**manifest, "metadata": {**manifest["metadata"], "namespace": CHILDREN_NAMESPACE}})
    if stored["kind"] != "TrainingRun":
        _check_children(cluster, label, _fleet_children(stored))
        return
    spec = b.run_spec(stored)
    children = [b.build_trainer_pod(stored, spec)]
    if (claim := b.build_snapshot_pvc(stored, spec)) is not None:
        children.append(claim)
    fleets = [b.build_rollout_fleet(stored, spec)]
    if (eval_fleet := b.build_eval_fleet(stored, spec)) is not None:
        fleets.append(eval_fleet)
    _check_children(cluster, label, children)
    for fleet in fleets:
        _check_children(cluster, label, _fleet_children(_dry_run_json(cluster, fleet)))
