"""Shared sub-specs of the rlfleet API.

These pydantic models are the single source of truth for field names, defaults and bounds: the CRD
YAML is generated from them, the local `rlfleet run` loader validates with them, and the
orchestrator reads its settings from them. Field names are the camelCase Kubernetes names; Python
code uses the snake_case attributes.

Validation is strict, like the API server's: a string is never coerced into a number or a boolean,
and a float is never accepted for an integer. Cross-field rules live next to the model they constrain
(`cel_rules`, see `rules.py`) and run both here and in the API server.
"""
from __future__ import annotations

import re
import types
import typing
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from rlfleet.crds import k8s_values as kv
from rlfleet.crds.managed import (
    ENV_NAME_CEL,
    ENV_NAME_MESSAGE,
    EXTRA_ARG_CEL,
    EXTRA_ARG_MAX,
    EXTRA_ARG_MESSAGE,
    env_name_reserved,
    extra_arg_allowed,
)
from rlfleet.crds.rules import Rule, only_when, raise_violations, value_rule

# Bounds on strings and lists keep the API server's CEL cost estimates finite and inputs sane.
SHORT = 253  # a Kubernetes name or label value
PATH = 4096
IMAGE = 512
QUANTITY_PATTERN = kv.QUANTITY
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.-]*$"
DNS1123_SUBDOMAIN_PATTERN = kv.DNS1123_SUBDOMAIN
CONFIG_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"


def _is_int_field(annotation: Any) -> bool:
    """int, or int | None (the bool subclass aside)."""
    if annotation is int:
        return True
    args = typing.get_args(annotation)
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and int in args and all(
        a in (int, type(None)) for a in args)


class ApiModel(BaseModel):
    """Base for every API object: camelCase on the wire, unknown fields rejected, strict types."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
        strict=True,
    )

    cel_rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        """An integer field takes an integral float (2.0) as the API server does; 2.5 stays an error."""
        if not isinstance(data, dict):
            return data
        fixed = None
        for name, info in cls.model_fields.items():
            key = info.alias or name
            value = data.get(key, data.get(name))
            if isinstance(value, float) and value.is_integer() and _is_int_field(info.annotation):
                fixed = fixed if fixed is not None else dict(data)
                fixed[key if key in data else name] = int(value)
        return data if fixed is None else fixed

    @model_validator(mode="after")
    def _check_rules(self):
        raise_violations(self)
        return self


class HealthSpec(ApiModel):
    """Heart-beat of every engine with GET /health_generate (a one-token generation): by the orchestrator of
    the run the fleet serves (all engines probed concurrently), or, in a fleet no run drives, by the kubelet
    (the engine pods' liveness probe, seconds rounded up; a startup probe holds it off while the model loads).
    A dead engine's slot is recreated within the fleet's recovery budgets. The operator applies
    startupTimeoutSeconds to every fleet."""

    interval_seconds: float = Field(5.0, gt=0, le=3600, description="Seconds between probes of an engine.")
    timeout_seconds: float = Field(5.0, gt=0, le=600, description="Bound on each probe.")
    first_wait_seconds: float = Field(
        0.0, ge=0, le=3600, description="Seconds to wait after the run's orchestrator resumes an engine (pauses "
        "for weight syncs and the heat guard) before probing it again; a fleet of no run is never paused (0)."
    )
    failure_threshold: int = Field(
        3, ge=1, le=100, description="Consecutive failed probes that mark an engine dead."
    )
    startup_timeout_seconds: float = Field(
        900.0, ge=1, le=86400,
        description="Bound on a new engine becoming healthy after it starts; past it the start counts as failed.",
    )


DEFAULT_WAIT_ALL_ALIVE_S = 300.0


class RecoverySpec(ApiModel):
    """Recreation of dead engine slots: budgets and exponential backoff."""

    max_restarts_per_engine: int = Field(5, ge=0, le=1000, description="Recreations allowed per slot.")
    max_restarts_per_run: int = Field(20, ge=0, le=100000,
                                      description="Recreations allowed per run, all slots; a resumed run goes on "
                                      "counting.")
    backoff_base_seconds: float = Field(1.0, ge=0, le=3600, description="First backoff delay; doubles per restart.")
    backoff_max_seconds: float = Field(60.0, ge=0, le=86400, description="Cap on the backoff delay.")
    wait_all_alive_timeout_seconds: float = Field(
        DEFAULT_WAIT_ALL_ALIVE_S, ge=1, le=86400,
        description="Bound on waiting for every slot to serve before a weight sync (the run's first start waits at "
        "least health.startupTimeoutSeconds).",
    )

    cel_rules = (
        Rule(
            cel="self.backoffBaseSeconds <= self.backoffMaxSeconds",
            check=lambda s: s.backoff_base_seconds <= s.backoff_max_seconds,
            field="backoffBaseSeconds",
            message="backoffBaseSeconds must not exceed backoffMaxSeconds",
        ),
    )


class WatchdogSpec(ApiModel):
    """The 503-storm watchdog: counts failed rollout requests in a sliding window."""

    enabled: bool = Field(True, description="Fail the run when the rollout engines stop serving.")
    window_seconds: int = Field(60, ge=1, le=86400, description="Length of the counting window.")
    check_interval_seconds: int = Field(30, ge=1, le=86400, description="Seconds between checks.")
    limit: int = Field(100, ge=0, le=10_000_000, description="A check is a strike when the window holds more failures.")
    checks: int = Field(10, ge=1, le=10000, description="Strikes in a row that trip the watchdog.")
    retrip_period_seconds: int | None = Field(
        None, ge=1, le=10_000_000,
        description="A trip within this many seconds of a recovery fails the run (recoveries are bounded); "
        "unset: 2 x checks x checkIntervalSeconds.",
    )

    def retrip_period(self) -> int:
        """Seconds after a recovery within which another trip fails the run."""
        if self.retrip_period_seconds is not None:
            return self.retrip_period_seconds
        return 2 * self.checks * self.check_interval_seconds

    cel_rules = (
        Rule(
            cel="!has(self.retripPeriodSeconds) || self.retripPeriodSeconds >= self.checks * self.checkIntervalSeconds",
            check=lambda s: s.retrip_period_seconds is None
            or s.retrip_period_seconds >= s.checks * s.check_interval_seconds,
            field="retripPeriodSeconds",
            message="retripPeriodSeconds must be at least checks x checkIntervalSeconds: a new trip takes that long "
            "after a recovery, so a shorter period would never bound the recoveries",
        ),
        Rule(
            cel="self.checkIntervalSeconds <= self.windowSeconds",
            check=lambda s: s.check_interval_seconds <= s.window_seconds,
            field="checkIntervalSeconds",
            message="checkIntervalSeconds must not exceed windowSeconds, or failures between windows go uncounted",
        ),
    )


class HeatSourceSpec(ApiModel):
    """Where GPU temperatures come from."""

    type: Literal["nvml", "dcgm", "prometheus", "file", "none"] = Field(
        "nvml",
        description="nvml: the GPU driver of the machine the run's orchestrator runs on (local runs; refused on "
        "Kubernetes, where it would read the trainer pod's GPUs); dcgm: a DCGM exporter (on Kubernetes its pod "
        "mapping keys the samples by engine pod; one exporter serves one node); prometheus: a Prometheus that "
        "scrapes the DCGM exporters of every node (Kubernetes only: DCGM_FI_DEV_GPU_TEMP of the engine pods, by "
        "their exported_pod or pod label); file: a text file.",
    )
    url: str | None = Field(None, max_length=PATH, pattern=kv.HTTP_URL,
                            description="http:// or https://: the DCGM exporter's metrics URL (type dcgm), or the "
                            "Prometheus base URL, e.g. http://prometheus.monitoring:9090 (type prometheus).")
    path: str | None = Field(
        None, max_length=PATH,
        description="File with one `<fleet>-<slot> <celsius>` line per rollout engine (type file): rollout-0 in a "
        "local run, <run>-rollout-0 on Kubernetes.",
    )

    cel_rules = (
        Rule(
            cel="!(self.type in ['dcgm', 'prometheus']) || has(self.url)",
            check=lambda s: s.type not in ("dcgm", "prometheus") or s.url is not None,
            field="url",
            message="source types dcgm and prometheus require url",
        ),
        Rule(
            cel="self.type != 'file' || has(self.path)",
            check=lambda s: s.type != "file" or s.path is not None,
            field="path",
            message="source type file requires path",
        ),
        only_when("url", "url", None, when_cel="self.type in ['dcgm', 'prometheus']",
                  when=lambda s: s.type in ("dcgm", "prometheus"),
                  message="url is read by source types dcgm and prometheus only; remove it"),
        only_when("path", "path", None, when_cel="self.type == 'file'", when=lambda s: s.type == "file",
                  message="path is read by source type file only; remove it"),
    )


class HeatGuardSpec(ApiModel):
    """Pause generation on a rollout engine whose GPU runs hot (eval engines are never paused)."""

    enabled: bool = Field(False, description="Turn the heat guard on.")
    pause_at_c: float = Field(84.0, ge=0, le=150, description="Pause generation at or above this temperature.")
    resume_at_c: float = Field(74.0, ge=0, le=150, description="Resume at or below this temperature.")
    min_pause_seconds: float = Field(45.0, ge=0, le=3600, description="Shortest pause.")
    max_pause_seconds: float = Field(120.0, ge=0, le=86400, description="Resume after this long regardless.")
    poll_interval_seconds: float = Field(5.0, gt=0, le=600, description="Seconds between temperature reads.")
    source: HeatSourceSpec = Field(default_factory=HeatSourceSpec)

    cel_rules = (
        Rule(
            cel="self.resumeAtC < self.pauseAtC",
            check=lambda s: s.resume_at_c < s.pause_at_c,
            field="resumeAtC",
            message="resumeAtC must be below pauseAtC",
        ),
        Rule(
            cel="self.minPauseSeconds <= self.maxPauseSeconds",
            check=lambda s: s.min_pause_seconds <= s.max_pause_seconds,
            field="minPauseSeconds",
            message="minPauseSeconds must not exceed maxPauseSeconds",
        ),
        Rule(
            cel="!self.enabled || self.source.type != 'none'",
            check=lambda s: not s.enabled or s.source.type != "none",
            field="source.type",
            message="an enabled heat guard needs a temperature source other than none",
        ),
    )


DEFAULT_SNAPSHOT_SIZE = "20Gi"


class SnapshotVolumeSpec(ApiModel):
    """The shared (ReadWriteMany) volume for weight and eval snapshots."""

    claim_name: str | None = Field(None, max_length=SHORT, pattern=DNS1123_SUBDOMAIN_PATTERN,
                                   description="Use this existing PersistentVolumeClaim (pods; a local run uses "
                                   "localPath).")
    size: str = Field(
        DEFAULT_SNAPSHOT_SIZE, max_length=64, pattern=QUANTITY_PATTERN,
        description="Size of the claim the operator creates when claimName is unset (a Kubernetes quantity; a "
        "local run uses localPath).",
    )
    storage_class_name: str | None = Field(
        None, max_length=SHORT, pattern=DNS1123_SUBDOMAIN_PATTERN,
        description="Storage class of the claim the operator creates (must offer ReadWriteMany; a local run uses "
        "localPath)."
    )
    local_path: str | None = Field(
        None, max_length=PATH,
        description="Directory used by local runs (default: a directory of the run, tmpfs when available); pods "
        "use the claim."
    )

    cel_rules = (
        Rule(
            cel="!has(self.claimName) || !has(self.storageClassName)",
            check=lambda s: s.claim_name is None or s.storage_class_name is None,
            field="storageClassName",
            message="storageClassName applies only to a created claim; remove it or claimName",
        ),
        only_when("size", "size", DEFAULT_SNAPSHOT_SIZE, when_cel="!has(self.claimName)",
                  when=lambda s: s.claim_name is None,
                  message="size is the size of a claim the operator creates: an existing claim (claimName) keeps "
                  "its own; remove size or claimName"),
        Rule(
            cel="quantity(self.size).isGreaterThan(quantity('0'))",
            check=lambda s: (kv.quantity(s.size) or 0) > 0,
            field="size",
            message="size must be greater than 0",
        ),
        # Fixed once a run exists with the rest of spec.weightSync (models.TrainingRunSpec): the operator
        # creates the claim once.
    )


MOUNT_PATH_RULE = Rule(
    cel="!self.mountPath.split('/').exists(p, p == '..') && !self.mountPath.startsWith('/dev/shm')",
    check=lambda s: not kv.path_has_dot_dot(s.mount_path) and not s.mount_path.startswith("/dev/shm"),
    field="mountPath",
    message="mountPath must not contain '..' nor lie under /dev/shm (the engines' shared memory)",
)


DEFAULT_BUCKET_MB = 512


class WeightSyncSpec(ApiModel):
    """How new weights reach the engines after each training step."""

    mode: Literal["disk", "broadcast"] = Field(
        "disk",
        description="disk: HF snapshots on the shared volume, loaded by every engine; broadcast: the trainer "
        "broadcasts the weights into every engine over one update group (nccl on GPUs, gloo on CPU, chosen "
        "from the devices), verified and falling back to disk (fallbackToDisk).",
    )
    transfer_timeout_seconds: float = Field(
        600.0, ge=1, le=86400,
        description="Bound on one weight transfer. In broadcast mode it bounds the whole transfer (begin to end), "
        "each bucket by its share of it by bytes (never below a floor a healthy engine meets), and the control "
        "steps by a short share of it.",
    )
    load_retries: int = Field(1, ge=0, le=10,
                              description="Retries of a failing disk load on an engine before it is treated as dead "
                              "(in broadcast mode an engine that stalls is dead at once; fallbackToDisk retries).")
    pause_mode: Literal["retract", "abort"] = Field(
        "retract",
        description="How engines pause generation during a load: retract keeps in-flight requests and "
        "finishes them on the new weights; abort returns them at once (finish reason abort).",
    )
    fallback_to_disk: bool = Field(
        True, description="In broadcast mode, finish a sync whose broadcast failed from the step's disk snapshot "
        "(false: the sync fails)."
    )
    bucket_megabytes: int = Field(
        DEFAULT_BUCKET_MB, ge=1, le=16384,
        description="Broadcast mode: tensors go in flattened buckets of at most this many MiB (one tensor may "
        "exceed it).",
    )
    verify_every: int = Field(
        1, ge=0, le=1000000,
        description="Compare every engine's served-weights checksums (/weights_checker, each of its ranks) with the "
        "trainer's checksums of what that rank holds, every N syncs that carry new weights (1: every one, 0: never); "
        "a mismatch marks the engine dead. CUDA engines are predicted as SGLang's own model code holds the weights "
        "(fused q/k/v and gate/up, padded vocabulary, tensor-parallel shards); CPU engines (its Transformers "
        "implementation) of tensorParallelSize > 1 and engines that quantize what they load (--quantization) are "
        "counted unverifiable.",
    )
    disk_verify: Literal["manifest", "full"] = Field(
        "manifest",
        description="Disk snapshots before any engine loads them: manifest checks the marker, manifest, sizes, "
        "headers and tensor table (files are hashed once, as they are written); full also re-hashes every file.",
    )
    keep_snapshots: int = Field(
        2, ge=1, le=100,
        description="Step snapshots kept on the volume, the one engines serve included (the launch weights always "
        "stay); on Kubernetes one more stays for a step, for a replacement pod created before the pin moved.",
    )
    mount_path: str = Field(
        "/snapshots", max_length=PATH, pattern=kv.MOUNT_PATH,
        description="Where the snapshot volume is mounted in pods (absolute; not /dev/shm, no `..`).",
    )

    # Fixed once a run exists with the rest of spec.weightSync (models.TrainingRunSpec): a running trainer
    # sends engines paths under its own mount; replacements mounting elsewhere could not load them.
    cel_rules = (
        MOUNT_PATH_RULE,
        only_when("fallbackToDisk", "fallback_to_disk", True, when_cel="self.mode == 'broadcast'",
                  when=lambda s: s.mode == "broadcast",
                  message="fallbackToDisk is what a broadcast sync does when its broadcast fails: mode disk has "
                  "no broadcast; remove it or set mode: broadcast"),
        only_when("bucketMegabytes", "bucket_megabytes", DEFAULT_BUCKET_MB, when_cel="self.mode == 'broadcast'",
                  when=lambda s: s.mode == "broadcast",
                  message="bucketMegabytes sizes the buckets of mode broadcast: mode disk sends none; remove it or "
                  "set mode: broadcast"),
    )
    snapshot_volume: SnapshotVolumeSpec = Field(default_factory=SnapshotVolumeSpec)


Quantity = Annotated[str, Field(max_length=64, pattern=kv.QUANTITY)]
LabelValue = Annotated[str, Field(max_length=63, pattern=kv.LABEL_VALUE)]
NODE_SELECTOR_RULE = Rule(
    cel=f"self.nodeSelector.all(k, k.size() <= 317 && k.matches({kv.cel_re(kv.LABEL_KEY)}))",
    check=lambda s: all(len(k) <= 317 and kv.matches(kv.LABEL_KEY, k) for k in s.node_selector),
    field="nodeSelector",
    message="node selector keys must be label keys: [prefix/]name, name at most 63 characters of [-A-Za-z0-9_.]",
)


# Top-level directories of the snapshot volume that rlfleet writes and removes itself.
VOLUME_OWN_DIRS = r"^(step_[0-9]+|eval|models)(/|$)"


class CheckpointSpec(ApiModel):
    """Trainer checkpoints, for a run that survives its trainer (`rlfleet run --resume`)."""

    interval_steps: int = Field(..., ge=1, le=10_000_000, description="Write a checkpoint every this many steps.")
    keep: int = Field(2, ge=1, le=1000, description="Complete checkpoints kept; older ones are removed.")
    path: str = Field(
        "checkpoints", min_length=1, max_length=PATH, pattern=r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$",
        description="Directory of the checkpoints, relative to the snapshot volume (local runs without "
        "snapshotVolume.localPath: relative to runs/<name>/).",
    )

    cel_rules = (
        Rule(
            cel="!self.path.matches('(^|/)[.][.]?(/|$)')",
            check=lambda s: not any(part in ("..", ".") for part in s.path.split("/")),
            field="path",
            message="the checkpoint path stays inside the volume: no '.' or '..' parts",
        ),
        Rule(
            cel=f"!self.path.matches('{VOLUME_OWN_DIRS}')",
            check=lambda s: re.match(VOLUME_OWN_DIRS, s.path) is None,
            field="path",
            message="step_<N>, eval and models on the snapshot volume are the run's weight snapshots, eval "
            "snapshots and model cache (removed as they retire): choose another directory",
        ),
    )


class TensorBoardSpec(ApiModel):
    """TensorBoard event files of the run's per-step record."""

    log_dir: str = Field(
        "tensorboard", min_length=1, max_length=PATH, pattern=r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$",
        description="Directory of the event files (one subdirectory per run), relative to the snapshot "
        "volume, so TensorBoard can be pointed at the claim (local runs without snapshotVolume.localPath: "
        "relative to the run directory).",
    )

    cel_rules = (
        Rule(
            cel="!self.logDir.matches('(^|/)[.][.]?(/|$)')",
            check=lambda s: not any(part in ("..", ".") for part in s.log_dir.split("/")),
            field="logDir",
            message="the TensorBoard directory stays inside the volume: no '.' or '..' parts",
        ),
    )


class MlflowSpec(ApiModel):
    """An MLflow tracking server: the run's record as metrics, the flattened spec as params."""

    tracking_uri: str = Field(..., max_length=PATH, pattern=kv.HTTP_URL,
                              description="The tracking server's URL, http:// or https://.")
    experiment: str = Field("rlfleet", min_length=1, max_length=500,
                            description="Experiment name (created when missing).")
    run_name: str | None = Field(None, min_length=1, max_length=250,
                                 description="The MLflow run's name; unset: the TrainingRun's name.")
    timeout_seconds: float = Field(10.0, gt=0, le=300,
                                   description="Bound on each call to the server; a call past it is a dropped record.")


# W&B's own rule for project and entity names: none of / \ # ? % :
WANDB_NAME_PATTERN = r"^[^/\\#?%:]+$"


class SecretKeySpec(ApiModel):
    """A value taken only from a Kubernetes Secret (never written in the manifest)."""

    secret_key_ref: KeyRefSpec = Field(..., description="The key of a Secret in the run's namespace.")


class WandbSpec(ApiModel):
    """Weights & Biases: the run's record as history, the flattened spec as its config. The W&B client runs
    in a process of its own, so a slow or unreachable server never holds training."""

    project: str = Field(..., min_length=1, max_length=128, pattern=WANDB_NAME_PATTERN,
                         description="The W&B project.")
    entity: str | None = Field(None, min_length=1, max_length=128, pattern=WANDB_NAME_PATTERN,
                               description="The user or team owning the project; unset: the API key's default.")
    run_name: str | None = Field(None, min_length=1, max_length=128,
                                 description="The W&B run's display name; unset: the TrainingRun's name.")
    mode: Literal["online", "offline"] = Field(
        "online", description="online: sent to the server as the run goes; offline: written to the run's "
        ".wandb log only (no network; upload later with `wandb sync`).")
    base_url: str | None = Field(None, max_length=PATH, pattern=kv.HTTP_URL,
                                 description="A W&B server's URL (dedicated or self-managed); unset: W&B's cloud.")
    api_key: SecretKeySpec | None = Field(
        None, description="The API key, from a Secret only: the operator sets it as the trainer pod's "
        "WANDB_API_KEY (Kubernetes only; a local run uses the machine's own W&B login).")
    timeout_seconds: float = Field(
        30.0, gt=0, le=600, description="Bound on starting the W&B run and on finishing it (W&B's init and finish "
        "timeouts; what is not uploaded by then stays in the run's .wandb log); a record the W&B process has not "
        "taken within it plus 30 s (that process's own start) is dropped.")


class TrackingSpec(ApiModel):
    """Where the per-step record goes besides the run summary. A tracker that fails never fails or stalls the
    run: it warns once, counts what it drops (rlfleet_tracker_records_total{outcome="dropped"}) and training
    goes on. A tracker whose client library is not installed where the run runs is refused before the run
    starts."""

    tensorboard: TensorBoardSpec | None = Field(None, description="TensorBoard event files; unset: none.")
    mlflow: MlflowSpec | None = Field(None, description="An MLflow tracking server; unset: none.")
    wandb: WandbSpec | None = Field(None, description="Weights & Biases; unset: none.")


class ResourcesSpec(ApiModel):
    """Container resources (Kubernetes quantities; pods only). GPUs come from the gpus / gpusPerEngine fields."""

    requests: dict[str, Quantity] = Field(default_factory=dict, max_length=16,
                                          description="Resource requests, e.g. cpu: \"4\".")
    limits: dict[str, Quantity] = Field(default_factory=dict, max_length=16,
                                        description="Resource limits, e.g. memory: 64Gi.")

    cel_rules = (
        Rule(
            cel=f"self.requests.all(k, k.matches({kv.cel_re(kv.RESOURCE_NAME)}))"
            f" && self.limits.all(k, k.matches({kv.cel_re(kv.RESOURCE_NAME)}))",
            check=lambda s: all(kv.matches(kv.RESOURCE_NAME, k) for k in (*s.requests, *s.limits)),
            field="",
            message="resource names are cpu, memory, ephemeral-storage, hugepages-<size> or a domain/name",
        ),
        Rule(
            cel=f"!('{kv.GPU_RESOURCE}' in self.requests) && !('{kv.GPU_RESOURCE}' in self.limits)",
            check=lambda s: kv.GPU_RESOURCE not in s.requests and kv.GPU_RESOURCE not in s.limits,
            field="",
            message=f"{kv.GPU_RESOURCE} is set from gpus / gpusPerEngine; do not name it in resources",
        ),
        Rule(
            cel="self.requests.all(k, !(k in self.limits)"
            " || quantity(self.requests[k]).compareTo(quantity(self.limits[k])) <= 0)",
            check=lambda s: all(k not in s.limits or (kv.quantity(v) or 0) <= (kv.quantity(s.limits[k]) or 0)
                                for k, v in s.requests.items()),
            field="requests",
            message="each request must not exceed its limit",
        ),
        Rule(
            cel="self.requests.all(k, !k.contains('/') || (k in self.limits"
            " && quantity(self.requests[k]).compareTo(quantity(self.limits[k])) == 0))",
            check=lambda s: all("/" not in k or (k in s.limits and kv.quantity(v) == kv.quantity(s.limits[k]))
                                for k, v in s.requests.items()),
            field="requests",
            message="an extended resource (domain/name) must have a limit equal to its request",
        ),
    )


class TolerationSpec(ApiModel):
    """A pod toleration, as in the core API."""

    key: str | None = Field(None, max_length=317, pattern=kv.LABEL_KEY,
                            description="Taint key; unset with operator Exists: every taint.")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Exists or Equal (the default).")
    value: str | None = Field(None, max_length=63, pattern=kv.LABEL_VALUE, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect; unset: every effect."
    )

    cel_rules = (
        Rule(
            cel="!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
            check=lambda s: s.operator != "Exists" or not s.value,
            field="value",
            message="a toleration with operator Exists takes no value",
        ),
        Rule(
            cel="has(self.key) || (has(self.operator) && self.operator == 'Exists')",
            check=lambda s: s.key is not None or s.operator == "Exists",
            field="operator",
            message="a toleration without a key must have operator Exists",
        ),
    )


class KeyRefSpec(ApiModel):
    """One key of a Secret or ConfigMap in the object's namespace."""

    name: str = Field(..., min_length=1, max_length=SHORT, pattern=DNS1123_SUBDOMAIN_PATTERN,
                      description="Name of the Secret or ConfigMap.")
    key: str = Field(..., min_length=1, max_length=SHORT, pattern=CONFIG_KEY_PATTERN, description="The key.")
    optional: bool | None = Field(None, description="Start the pod even when the object or key is missing.")


class EnvVarSourceSpec(ApiModel):
    """Where a variable's value comes from (Kubernetes only: a local run has no API server to ask)."""

    secret_key_ref: KeyRefSpec | None = Field(None, description="A key of a Secret.")
    config_map_key_ref: KeyRefSpec | None = Field(None, description="A key of a ConfigMap.")

    cel_rules = (
        Rule(
            cel="has(self.secretKeyRef) != has(self.configMapKeyRef)",
            check=lambda s: (s.secret_key_ref is None) != (s.config_map_key_ref is None),
            field="",
            message="set exactly one of secretKeyRef and configMapKeyRef",
        ),
    )

    def to_pod(self) -> dict[str, Any]:
        """The core API `valueFrom` object."""
        return wire_dump(self)


class EnvVarSpec(ApiModel):
    """An environment variable of the engine process or container: a value, or a reference to one."""

    name: str = Field(..., min_length=1, max_length=SHORT, pattern=ENV_NAME_PATTERN, description="Variable name.")
    value: str | None = Field(None, max_length=PATH, description="Variable value (\"\" for empty).")
    value_from: EnvVarSourceSpec | None = Field(
        None, description="The value from a Secret or ConfigMap key (Kubernetes only), instead of value."
    )

    cel_rules = (
        Rule(
            cel="has(self.value) != has(self.valueFrom)",
            check=lambda s: (s.value is None) != (s.value_from is None),
            field="value",
            message="set exactly one of value and valueFrom",
        ),
        Rule(
            cel=ENV_NAME_CEL,
            check=lambda s: not env_name_reserved(s.name),
            field="name",
            message=ENV_NAME_MESSAGE,
        ),
    )

    def to_pod(self) -> dict[str, Any]:
        """The core API `EnvVar` object."""
        if self.value_from is not None:
            return {"name": self.name, "valueFrom": self.value_from.to_pod()}
        return {"name": self.name, "value": self.value or ""}


# One extraArgs item: anything but a flag the command builder sets (rlfleet.crds.managed).
ExtraArg = Annotated[
    str,
    Field(max_length=EXTRA_ARG_MAX),
    *value_rule(EXTRA_ARG_CEL, extra_arg_allowed, EXTRA_ARG_MESSAGE),
]


# SGLang's data-parallel attention: the --dp-size replicas share the tensor-parallel GPUs of one engine.
DP_ATTENTION_FLAG = "--enable-dp-attention"


class EngineSpec(ApiModel):
    """One SGLang engine: what the single command-line builder turns into a pod or a process."""

    image: str = Field("lmsysorg/sglang:v0.5.23", max_length=IMAGE, pattern=kv.IMAGE,
                       description="Container image of the engine pod (a local run uses the installed SGLang).")
    model_path: str = Field(..., min_length=1, max_length=PATH,
                            description="Model directory served at start: a path in the engine's image or on a "
                            "volume it mounts. Engines run offline (HF_HUB_OFFLINE=1): to have SGLang download a "
                            "hub id instead, set HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE to 0 in env.")
    device: Literal["cuda", "cpu"] = Field(
        "cuda", description="cpu runs `--device cpu --model-impl transformers --sleep-on-idle`."
    )
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="SGLang --tp-size.")
    pipeline_parallel_size: int = Field(1, ge=1, le=64, description="SGLang --pp-size.")
    data_parallel_size: int = Field(1, ge=1, le=64, description="SGLang --dp-size.")
    expert_parallel_size: int = Field(1, ge=1, le=64, description="SGLang --ep-size.")
    gpus_per_engine: int = Field(1, ge=0, le=64, description="GPUs requested per engine pod (cuda only).")
    port: int = Field(30000, ge=1024, le=65535,
                      description="Port the engine listens on in its pod (a local run picks free ports).")
    max_total_tokens: int | None = Field(None, ge=1, le=100_000_000,
                                         description="SGLang --max-total-tokens; unset on CPU: 8192 (SGLang's own "
                                         "sizing needs a GPU).")
    mem_fraction_static: float | None = Field(None, gt=0, lt=1, description="SGLang --mem-fraction-static.")
    attention_backend: str | None = Field(None, max_length=64, description="SGLang --attention-backend.")
    extra_args: list[ExtraArg] = Field(
        default_factory=list, max_length=128,
        description="More SGLang arguments, passed verbatim after the managed ones; flags rlfleet sets "
        "(--model-path, --host, --port, --tp-size, --api-key, ...) are refused.",
    )
    env: list[EnvVarSpec] = Field(default_factory=list, max_length=128, description="Extra environment variables.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    node_selector: dict[str, LabelValue] = Field(default_factory=dict, max_length=32,
                                                 description="Pod node selector (pods only).")
    tolerations: list[TolerationSpec] = Field(default_factory=list, max_length=32,
                                              description="Pod tolerations (pods only).")

    cel_rules = (
        NODE_SELECTOR_RULE,
        Rule(
            cel="self.device != 'cuda' || self.gpusPerEngine >= self.tensorParallelSize * self.pipelineParallelSize"
            f" * (self.extraArgs.exists(a, a == '{DP_ATTENTION_FLAG}') ? 1 : self.dataParallelSize)",
            check=lambda s: s.device != "cuda" or s.gpus_per_engine >= engine_gpus_needed(s),
            field="gpusPerEngine",
            message="gpusPerEngine must be at least tensorParallelSize x pipelineParallelSize x dataParallelSize on "
            f"cuda (dataParallelSize counts once with {DP_ATTENTION_FLAG}, whose replicas share the tensor-parallel "
            "GPUs)",
        ),
        Rule(
            cel="self.device == 'cuda' || self.gpusPerEngine <= 1",
            check=lambda s: s.device == "cuda" or s.gpus_per_engine <= 1,
            field="gpusPerEngine",
            message="gpusPerEngine counts a cuda engine's GPUs; a cpu engine uses none: set 0 or leave it out",
        ),
    )


def engine_gpus_needed(engine: EngineSpec) -> int:
    """The GPUs one SGLang engine of this layout uses: tp x pp per data-parallel replica, and one replica's
    worth when the replicas share them (data-parallel attention)."""
    replicas = 1 if DP_ATTENTION_FLAG in engine.extra_args else engine.data_parallel_size
    return engine.tensor_parallel_size * engine.pipeline_parallel_size * replicas


def literal_env(env: Sequence[EnvVarSpec]) -> dict[str, str]:
    """The variables of `env` given as values (a local process's; valueFrom is for pods only)."""
    return {e.name: e.value for e in env if e.value is not None}


def wire_dump(model: BaseModel) -> dict[str, Any]:
    """The object as it appears on the wire: camelCase keys, unset optional fields left out."""
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)
