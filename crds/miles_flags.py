"""Where each Miles setting that matters lives in the TrainingRun API, and how the defaults compare.

Rendered into the API reference; a unit test checks that every field named here exists and has the
default stated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NO_DEFAULT = object()


@dataclass(frozen=True)
class FlagMapping:
    flag: str
    miles_default: str
    field: str  # dotted TrainingRun path, "" when there is no field (always on)
    default: Any = NO_DEFAULT  # our default, checked against the schema
    note: str = ""


MILES_FLAGS: tuple[FlagMapping, ...] = (
    FlagMapping("--use-fault-tolerance", "False", "",
                note="Always on: health checks, recovery and the watchdog need no switch."),
    FlagMapping("--rollout-health-check-interval", "30", "spec.rollout.health.intervalSeconds", 5.0,
                note="Every engine probed concurrently, not one by one."),
    FlagMapping("--rollout-health-check-timeout", "30", "spec.rollout.health.timeoutSeconds", 5.0),
    FlagMapping("--rollout-health-check-first-wait", "0", "spec.rollout.health.firstWaitSeconds", 0.0),
    FlagMapping("(none: one failed probe kills)", "1", "spec.rollout.health.failureThreshold", 3,
                note="Consecutive failures before an engine is marked dead."),
    FlagMapping("(none: engine boot wait is unbounded)", "no timeout", "spec.rollout.health.startupTimeoutSeconds",
                900.0),
    FlagMapping("(none: no restart cap)", "unlimited", "spec.rollout.recovery.maxRestartsPerEngine", 5),
    FlagMapping("(none: no restart cap)", "unlimited", "spec.rollout.recovery.maxRestartsPerRun", 20),
    FlagMapping("(none: no backoff)", "none", "spec.rollout.recovery.backoffBaseSeconds", 1.0),
    FlagMapping("wait_all_engines_alive timeout (hard-coded)", "600",
                "spec.rollout.recovery.waitAllAliveTimeoutSeconds", 300.0),
    FlagMapping("(none: no minimum of healthy engines)", "none", "spec.rollout.minReadyEngines", 1),
    FlagMapping("--rollout-num-gpus / --rollout-num-gpus-per-engine", "-", "spec.rollout.replicas", 1,
                note="With spec.rollout.engine.tensorParallelSize and gpusPerEngine."),
    FlagMapping("--rollout-num-gpus-per-engine", "1", "spec.rollout.engine.tensorParallelSize", 1),
    FlagMapping("--sglang-server-concurrency", "512", "spec.rollout.concurrencyPerEngine", 64),
    FlagMapping("--sglang-router-request-timeout-secs", "14400", "spec.rollout.requestTimeoutSeconds", 600.0),
    FlagMapping("http_utils.post retries (hard-coded)", "60 x 1 s", "spec.rollout.maxRetries", 3,
                note="Classified errors, backoff, a request deadline."),
    FlagMapping("--router-health-check-interval-secs", "router default",
                "spec.rollout.router.healthCheckIntervalSeconds", 2),
    FlagMapping("--router-health-failure-threshold", "router default", "spec.rollout.router.healthFailureThreshold", 2),
    FlagMapping("--sglang-router-policy", "unset", "spec.rollout.router.policy", "cache_aware"),
    FlagMapping("--update-weight-transfer-mode", "broadcast", "spec.weightSync.mode", "disk",
                note="disk works everywhere; broadcast (nccl on GPUs, gloo on CPU) falls back to disk."),
    FlagMapping("--p2p-transfer-timeout", "30", "spec.weightSync.transferTimeoutSeconds", 600.0,
                note="Bounds every transfer mode, and a timeout fails the sync instead of only being logged."),
    FlagMapping("--pause-generation-mode", "retract", "spec.weightSync.pauseMode", "retract",
                note="in_place is not offered: it swaps weights but answers 400 and leaves a stale cache."),
    FlagMapping("--num-rollout", "-", "spec.trainer.steps", 100),
    FlagMapping("--rollout-batch-size", "-", "spec.trainer.promptsPerStep", 32),
    FlagMapping("--n-samples-per-prompt", "1", "spec.trainer.samplesPerPrompt", 8),
    FlagMapping("--rollout-max-response-len", "-", "spec.trainer.maxNewTokens", 1024),
    FlagMapping("--rollout-temperature", "1.0", "spec.trainer.temperature", 1.0),
    FlagMapping("--rollout-top-p", "1.0", "spec.trainer.topP", 1.0),
    FlagMapping("--lr", "-", "spec.trainer.learningRate", 1e-6),
    FlagMapping("--eps-clip", "0.2", "spec.trainer.epsClip", 0.2),
    FlagMapping("--kl-loss-coef", "0", "spec.trainer.klCoef", 0.0,
                note="The KL-to-reference loss term (Miles: with --use-kl-loss --kl-loss-type low_var_kl, the k3 "
                     "estimator); a coefficient above 0 turns it on. Miles' --kl-coef (KL in the reward) has no "
                     "field."),
    FlagMapping("--clip-grad", "1.0", "spec.trainer.gradClip", 1.0),
    FlagMapping("--micro-batch-size", "-", "spec.trainer.microBatchSize"),
    FlagMapping("--tensor-model-parallel-size", "1", "spec.trainer.tensorParallelSize", 1),
    FlagMapping("--pipeline-model-parallel-size", "1", "spec.trainer.pipelineParallelSize", 1),
    FlagMapping("--seed", "-", "spec.trainer.seed", 0),
    FlagMapping("--rollout-function-path / --custom-rm-path", "-", "spec.trainer.rewardFunction"),
    FlagMapping("--eval-interval", "None", "spec.eval.intervalSteps", 10),
    FlagMapping("--skip-eval-before-train", "False", "spec.eval.evalBeforeTrain", True),
    FlagMapping("--eval-prompt-data / --eval-config", "None", "spec.eval.datasets"),
    FlagMapping("--n-samples-per-eval-prompt", "1", "spec.eval.datasets[].samplesPerPrompt", 1),
    FlagMapping("--eval-max-response-len", "None", "spec.eval.datasets[].maxNewTokens"),
    FlagMapping("--eval-temperature", "None", "spec.eval.datasets[].temperature"),
    FlagMapping("--eval-top-p", "None", "spec.eval.datasets[].topP"),
    FlagMapping("--eval-input-key", "None", "spec.eval.datasets[].inputKey", "prompt"),
    FlagMapping("--eval-label-key", "None", "spec.eval.datasets[].labelKey", "answer"),
    FlagMapping("--eval-num-gpus", "0", "spec.eval.fleet.replicas", 1, note="Set spec.eval.posture to fleet."),
    FlagMapping("--eval-num-gpus-per-engine", "1", "spec.eval.fleet.engine.tensorParallelSize",
                note="Unset inherits the rollout engines'; a different value resets TP-coupled settings to 1."),
    FlagMapping("--eval-sglang-*", "inherit --sglang-*", "spec.eval.fleet.engine"),
    FlagMapping("--eval-function-path (CheckpointEvalFn)", "rollout fn", "spec.eval.external.classPath",
                note="Set spec.eval.posture to external."),
    FlagMapping("--eval-hf-dir", "None", "spec.weightSync.snapshotVolume",
                note="Eval snapshots go to <volume>/eval/step_<N>/."),
    FlagMapping("--eval-max-in-flight", "2", "spec.eval.maxInFlight", 2),
    FlagMapping("--eval-overflow-policy", "backpressure", "spec.eval.overflowPolicy", "backpressure"),
    FlagMapping("--eval-keep-snapshots", "2", "spec.eval.keepSnapshots", 2),
    FlagMapping("EVAL_WEIGHT_LOAD_TIMEOUT_SECS (hard-coded)", "600", "spec.eval.pinTimeoutSeconds", 600.0),
    FlagMapping("_pin_fleet retries (hard-coded)", "2", "spec.eval.pinRetries", 2),
    FlagMapping("_wait_router_ready (hard-coded)", "180", "spec.eval.routerProbeTimeoutSeconds", 180.0),
)
