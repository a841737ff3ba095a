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

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from rlfleet.crds.rules import Rule, immutable, raise_violations

# Bounds on strings and lists keep the API server's CEL cost estimates finite and inputs sane.
SHORT = 253  # a Kubernetes name or label value
PATH = 4096
IMAGE = 512
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.-]*$"


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

    @model_validator(mode="after")
    def _check_rules(self):
        raise_violations(self)
        return self


class HealthSpec(ApiModel):
    """Heart-beat of every engine with GET /health_generate (all engines probed concurrently)."""

    interval_seconds: float = Field(5.0, gt=0, le=3600, description="Seconds between probe rounds.")
    timeout_seconds: float = Field(5.0, gt=0, le=600, description="Bound on each probe.")
    first_wait_seconds: float = Field(
        0.0, ge=0, le=3600, description="Seconds to wait after every resume before probing again."
    )
    failure_threshold: int = Field(
        3, ge=1, le=100, description="Consecutive failed probes that mark an engine dead."
    )
    startup_timeout_seconds: float = Field(
        900.0, ge=1, le=86400,
        description="Bound on a new engine becoming healthy after it starts; past it the start counts as failed.",
    )


class RecoverySpec(ApiModel):
    """Recreation of dead engine slots: budgets and exponential backoff."""

    max_restarts_per_engine: int = Field(5, ge=0, le=1000, description="Recreations allowed per slot.")
    max_restarts_per_run: int = Field(20, ge=0, le=100000, description="Recreations allowed per run, all slots.")
    backoff_base_seconds: float = Field(1.0, ge=0, le=3600, description="First backoff delay; doubles per restart.")
    backoff_max_seconds: float = Field(60.0, ge=0, le=86400, description="Cap on the backoff delay.")
    wait_all_alive_timeout_seconds: float = Field(
        300.0, ge=1, le=86400, description="Bound on waiting for every slot to serve before a weight sync."
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
            cel="self.checkIntervalSeconds <= self.windowSeconds",
            check=lambda s: s.check_interval_seconds <= s.window_seconds,
            field="checkIntervalSeconds",
            message="checkIntervalSeconds must not exceed windowSeconds, or failures between windows go uncounted",
        ),
    )


class HeatSourceSpec(ApiModel):
    """Where GPU temperatures come from."""

    type: Literal["nvml", "dcgm", "file", "none"] = Field(
        "nvml", description="nvml: the GPU driver on each engine's node; dcgm: a DCGM exporter; file: a text file."
    )
    url: str | None = Field(None, max_length=PATH, description="DCGM exporter metrics URL (type dcgm).")
    path: str | None = Field(
        None, max_length=PATH, description="File with one `<engine-slot> <celsius>` line per GPU (type file)."
    )

    cel_rules = (
        Rule(
            cel="self.type != 'dcgm' || has(self.url)",
            check=lambda s: s.type != "dcgm" or s.url is not None,
            field="url",
            message="source type dcgm requires url",
        ),
        Rule(
            cel="self.type != 'file' || has(self.path)",
            check=lambda s: s.type != "file" or s.path is not None,
            field="path",
            message="source type file requires path",
        ),
    )


class HeatGuardSpec(ApiModel):
    """Pause generation on an engine whose GPU runs hot."""

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


class SnapshotVolumeSpec(ApiModel):
    """The shared (ReadWriteMany) volume for weight and eval snapshots."""

    claim_name: str | None = Field(None, max_length=SHORT, description="Use this existing PersistentVolumeClaim.")
    size: str = Field(
        "20Gi", max_length=64, pattern=QUANTITY_PATTERN,
        description="Size of the claim the operator creates when claimName is unset (a Kubernetes quantity).",
    )
    storage_class_name: str | None = Field(
        None, max_length=SHORT, description="Storage class of the created claim (must offer ReadWriteMany)."
    )
    local_path: str | None = Field(
        None, max_length=PATH,
        description="Directory used by local runs (default: a directory of the run, tmpfs when available)."
    )

    cel_rules = (
        Rule(
            cel="!has(self.claimName) || !has(self.storageClassName)",
            check=lambda s: s.claim_name is None or s.storage_class_name is None,
            field="storageClassName",
            message="storageClassName applies only to a created claim; remove it or claimName",
        ),
        immutable("claimName", "claim_name", "the snapshot volume's claimName"),
    )


class WeightSyncSpec(ApiModel):
    """How new weights reach the engines after each training step."""

    mode: Literal["disk", "nccl"] = Field(
        "disk", description="disk: HF snapshots on the shared volume; nccl: GPU broadcast with disk fallback."
    )
    transfer_timeout_seconds: float = Field(600.0, ge=1, le=86400, description="Bound on one weight transfer.")
    load_retries: int = Field(1, ge=0, le=10, description="Retries of a failing engine before it is treated as dead.")
    pause_mode: Literal["retract", "abort"] = Field(
        "retract",
        description="How engines pause generation during a load: retract keeps in-flight requests and "
        "finishes them on the new weights; abort returns them at once (finish reason abort).",
    )
    fallback_to_disk: bool = Field(True, description="In nccl mode, load from a disk snapshot when a broadcast fails.")
    keep_snapshots: int = Field(
        2, ge=1, le=100, description="Weight snapshots kept on the volume (replacement engines start from the newest)."
    )
    mount_path: str = Field(
        "/snapshots", max_length=PATH, pattern=r"^/", description="Where the snapshot volume is mounted in pods."
    )
    snapshot_volume: SnapshotVolumeSpec = Field(default_factory=SnapshotVolumeSpec)


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
    )


class ResourcesSpec(ApiModel):
    """Container resources (Kubernetes quantities). GPUs come from the gpus / gpusPerEngine fields."""

    requests: dict[str, str] = Field(default_factory=dict, max_length=16,
                                     description="Resource requests, e.g. cpu: \"4\".")
    limits: dict[str, str] = Field(default_factory=dict, max_length=16,
                                   description="Resource limits, e.g. memory: 64Gi.")


class TolerationSpec(ApiModel):
    """A pod toleration, as in the core API."""

    key: str | None = Field(None, max_length=SHORT, description="Taint key; unset with operator Exists: every taint.")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Exists or Equal (the default).")
    value: str | None = Field(None, max_length=SHORT, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect; unset: every effect."
    )


class EnvVarSpec(ApiModel):
    """An environment variable of the engine process or container."""

    name: str = Field(..., min_length=1, max_length=SHORT, pattern=ENV_NAME_PATTERN, description="Variable name.")
    value: str = Field("", max_length=PATH, description="Variable value.")


class EngineSpec(ApiModel):
    """One SGLang engine: what the single command-line builder turns into a pod or a process."""

    image: str = Field("lmsysorg/sglang:v0.5.23", max_length=IMAGE, description="Container image of the engine.")
    model_path: str = Field(..., min_length=1, max_length=PATH,
                            description="Model directory or hub id served at start.")
    device: Literal["cuda", "cpu"] = Field(
        "cuda", description="cpu runs `--device cpu --model-impl transformers --sleep-on-idle`."
    )
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="SGLang --tp-size.")
    pipeline_parallel_size: int = Field(1, ge=1, le=64, description="SGLang --pp-size.")
    data_parallel_size: int = Field(1, ge=1, le=64, description="SGLang --dp-size.")
    expert_parallel_size: int = Field(1, ge=1, le=64, description="SGLang --ep-size.")
    gpus_per_engine: int = Field(1, ge=0, le=64, description="GPUs requested per engine pod (cuda only).")
    port: int = Field(30000, ge=1024, le=65535, description="Port the engine listens on.")
    max_total_tokens: int | None = Field(None, ge=1, le=100_000_000,
                                         description="SGLang --max-total-tokens (required on CPU).")
    mem_fraction_static: float | None = Field(None, gt=0, lt=1, description="SGLang --mem-fraction-static.")
    attention_backend: str | None = Field(None, max_length=64, description="SGLang --attention-backend.")
    extra_args: list[str] = Field(
        default_factory=list, max_length=128, description="More SGLang arguments, passed verbatim."
    )
    env: list[EnvVarSpec] = Field(default_factory=list, max_length=128, description="Extra environment variables.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    node_selector: dict[str, str] = Field(default_factory=dict, max_length=32, description="Pod node selector.")
    tolerations: list[TolerationSpec] = Field(default_factory=list, max_length=32, description="Pod tolerations.")

    cel_rules = (
        Rule(
            cel="self.device != 'cuda' || self.gpusPerEngine >= self.tensorParallelSize * self.pipelineParallelSize",
            check=lambda s: s.device != "cuda"
            or s.gpus_per_engine >= s.tensor_parallel_size * s.pipeline_parallel_size,
            field="gpusPerEngine",
            message="gpusPerEngine must be at least tensorParallelSize x pipelineParallelSize on cuda",
        ),
    )


def wire_dump(model: BaseModel) -> dict[str, Any]:
    """The object as it appears on the wire: camelCase keys, unset optional fields left out."""
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)
