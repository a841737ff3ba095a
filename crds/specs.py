"""Shared sub-specs of the rlfleet API.

These pydantic models are the single source of truth for field names, defaults and bounds: the CRD
YAML is generated from them, the local `rlfleet run` loader validates with them, and the
orchestrator reads its settings from them. Field names are the camelCase Kubernetes names; Python
code uses the snake_case attributes.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class ApiModel(BaseModel):
    """Base for every API object: camelCase on the wire, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
    )


class HealthSpec(ApiModel):
    """Heart-beat of every engine with GET /health_generate (all engines probed concurrently)."""

    interval_seconds: float = Field(5.0, ge=0.1, le=3600, description="Seconds between probe rounds.")
    timeout_seconds: float = Field(5.0, ge=0.1, le=600, description="Bound on each probe.")
    first_wait_seconds: float = Field(
        0.0, ge=0, le=3600, description="Seconds to wait after every resume before probing again."
    )
    failure_threshold: int = Field(
        3, ge=1, le=100, description="Consecutive failed probes that mark an engine dead."
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


class WatchdogSpec(ApiModel):
    """The 503-storm watchdog: counts failed rollout requests in a sliding window."""

    window_seconds: int = Field(60, ge=1, le=86400, description="Length of the counting window.")
    check_interval_seconds: int = Field(30, ge=1, le=86400, description="Seconds between checks.")
    limit: int = Field(100, ge=0, le=10_000_000, description="A check is a strike when the window holds more failures.")
    checks: int = Field(10, ge=1, le=10000, description="Strikes in a row that trip the watchdog.")


class HeatSourceSpec(ApiModel):
    type: Literal["nvml", "dcgm", "file", "none"] = Field("none", description="Where temperatures come from.")
    url: str | None = Field(None, description="DCGM exporter metrics URL (type dcgm).")
    path: str | None = Field(None, description="File with one `<engine-slot> <celsius>` line per GPU (type file).")


class HeatGuardSpec(ApiModel):
    """Pause generation on an engine whose GPU runs hot."""

    enabled: bool = Field(False, description="Turn the heat guard on.")
    pause_at_c: float = Field(84.0, ge=0, le=150, description="Pause generation at or above this temperature.")
    resume_at_c: float = Field(74.0, ge=0, le=150, description="Resume at or below this temperature.")
    min_pause_seconds: float = Field(45.0, ge=0, le=3600, description="Shortest pause.")
    max_pause_seconds: float = Field(120.0, ge=0, le=86400, description="Resume after this long regardless.")
    source: HeatSourceSpec = Field(default_factory=HeatSourceSpec)


class SnapshotVolumeSpec(ApiModel):
    """The shared (ReadWriteMany) volume for weight and eval snapshots."""

    claim_name: str | None = Field(None, description="Use this existing PersistentVolumeClaim.")
    size: str = Field("20Gi", description="Size of the claim the operator creates when claimName is unset.")
    storage_class_name: str | None = Field(None, description="Storage class of the created claim.")
    local_path: str | None = Field(None, description="Directory used by local runs (default: a run directory).")


class WeightSyncSpec(ApiModel):
    mode: Literal["disk", "nccl"] = Field("disk", description="disk: HF snapshots on the shared volume; nccl: GPU broadcast with disk fallback.")
    transfer_timeout_seconds: float = Field(600.0, ge=1, le=86400, description="Bound on one weight transfer.")
    load_retries: int = Field(1, ge=0, le=10, description="Retries of a failing engine before it is treated as dead.")
    mount_path: str = Field("/snapshots", description="Where the snapshot volume is mounted in pods.")
    snapshot_volume: SnapshotVolumeSpec = Field(default_factory=SnapshotVolumeSpec)


class ResourcesSpec(ApiModel):
    requests: dict[str, str] = Field(default_factory=dict)
    limits: dict[str, str] = Field(default_factory=dict)


class TolerationSpec(ApiModel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


class EnvVarSpec(ApiModel):
    name: str = Field(..., min_length=1)
    value: str = ""


class EngineSpec(ApiModel):
    """One SGLang engine: what the single command-line builder turns into a pod or a process."""

    image: str = Field("lmsysorg/sglang:v0.5.23", description="Container image of the engine.")
    model_path: str = Field(..., min_length=1, description="Model directory or hub id served at start.")
    device: Literal["cuda", "cpu"] = Field("cuda", description="cpu runs `--device cpu --model-impl transformers --sleep-on-idle`.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="SGLang --tp-size.")
    gpus_per_engine: int = Field(1, ge=0, le=64, description="GPUs requested per engine pod.")
    port: int = Field(30000, ge=1024, le=65535, description="Port the engine listens on.")
    max_total_tokens: int | None = Field(None, ge=1, description="SGLang --max-total-tokens (required on CPU).")
    mem_fraction_static: float | None = Field(None, gt=0, lt=1, description="SGLang --mem-fraction-static.")
    attention_backend: str | None = Field(None, description="SGLang --attention-backend.")
    extra_args: list[str] = Field(default_factory=list, description="More SGLang arguments, passed verbatim.")
    env: list[EnvVarSpec] = Field(default_factory=list)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[TolerationSpec] = Field(default_factory=list)
