"""Status of TrainingRuns and fleets: what the operator and the orchestrator report.

Conditions follow the Kubernetes conventions (type, status, reason, message, lastTransitionTime).
A few short text fields (`ready`, `lastEval.summary`) exist only for `kubectl get` columns and are
derived from the counted fields when not given.
"""
from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator
from pydantic.json_schema import JsonDict

from rlfleet.crds.specs import PATH, SHORT, ApiModel

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Failed")
RunPhase = Literal["Pending", "Running", "Succeeded", "Failed"]
SlotState = Literal["Pending", "Starting", "Ready", "Dead", "Recreating", "Failed"]
REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
MESSAGE = 32768
# Lists keyed by a field: one entry per condition type / slot, merged by key on server-side apply.
CONDITION_LIST: JsonDict = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}
SLOT_LIST: JsonDict = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["slot"]}


def _rfc3339(value: str) -> str:
    try:
        datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as e:
        raise ValueError(f"not an RFC 3339 time: {value!r}") from e
    return value


Timestamp = Annotated[
    str,
    AfterValidator(_rfc3339),
    Field(max_length=64, json_schema_extra={"format": "date-time"}),
]


def now_rfc3339(clock: datetime | None = None) -> str:
    """A Kubernetes-style timestamp (UTC, seconds, Z)."""
    return (clock or datetime.now(UTC)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Condition(ApiModel):
    """A Kubernetes-style condition."""

    type: Literal["Ready", "Progressing", "Degraded", "Failed"] = Field(..., description="Condition type.")
    status: Literal["True", "False", "Unknown"] = Field(..., description="True, False or Unknown.")
    reason: str = Field(
        ..., min_length=1, max_length=1024, pattern=REASON_PATTERN,
        description="CamelCase reason, e.g. RolloutEnginesUnavailable.",
    )
    message: str = Field("", max_length=MESSAGE, description="Human-readable details (may quote an engine's log).")
    last_transition_time: Timestamp = Field(..., description="When status last changed.")
    observed_generation: int | None = Field(None, ge=0, description="The spec generation the condition was set for.")


class FailureStatus(ApiModel):
    """Why an engine slot last failed."""

    reason: str = Field(..., min_length=1, max_length=1024, pattern=REASON_PATTERN,
                        description="e.g. ProbeTimeout, Crashed.")
    message: str = Field("", max_length=MESSAGE, description="Details: the engine's last log lines or the probe error.")
    exit_code: int | None = Field(None, description="Process or container exit code, when it exited.")
    time: Timestamp | None = Field(None, description="When it failed.")


class EngineSlotStatus(ApiModel):
    """One engine slot of a fleet."""

    slot: int = Field(..., ge=0, le=65535, description="Stable slot index.")
    pod: str | None = Field(None, max_length=SHORT, description="Pod (or local process) currently in the slot.")
    url: str | None = Field(None, max_length=PATH, description="Engine base URL.")
    state: SlotState = Field(
        "Pending", description="Slot state."
    )
    restarts: int = Field(0, ge=0, description="Recreations of this slot.")
    weight_version: str | None = Field(None, max_length=SHORT, description="Weight version read back from the engine.")
    last_failure: FailureStatus | None = Field(None, description="The slot's most recent failure.")


def ready_text(ready: int, total: int) -> str:
    """`ready/total` engines, as the `Ready` column and the Ready conditions show it."""
    return f"{ready}/{total}"


def status_dump(status: ApiModel) -> dict[str, Any]:
    """A status as written to /status: camelCase, only the fields given (None ones left out).

    Only what was set is written, so a slot entry or failure copied from another status (a fleet's
    slots into its run's) is written back exactly as it was read.
    """
    return status.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude_none=True)


class LastEvalStatus(ApiModel):
    """The most recent evaluation point, and skip counts so far."""

    step: int = Field(..., ge=0, description="Training step the point belongs to.")
    weight_version: str | None = Field(None, max_length=SHORT, description="Weight version every eval engine reported.")
    scores: dict[str, float] = Field(default_factory=dict, max_length=64, description="Score per dataset.")
    skipped_reason: str | None = Field(
        None, max_length=64,
        description="Why this point was skipped (busy, export_failed, ckpt_missing, unhealthy, pin_violation, "
        "crashed, custom)."
    )
    skipped: dict[str, int] = Field(default_factory=dict, max_length=64,
                                    description="Skipped points so far, by reason.")
    time: Timestamp | None = Field(None, description="When the point settled.")
    summary: str | None = Field(None, max_length=256, description="One-line summary for kubectl get.")

    @model_validator(mode="after")
    def _fill_summary(self):
        if self.summary is None:
            if self.skipped_reason:
                what = f"skipped {self.skipped_reason}"
            else:
                what = " ".join(f"{k}={v:.3g}" for k, v in sorted(self.scores.items())) or "no scores"
            self.summary = f"@{self.step} {what}"[:256]
        return self


class EngineMark(ApiModel):
    """What the run's orchestrator says about one engine pod (the pod named by `podUID`, no other)."""

    pod_uid: str = Field(..., alias="podUID", min_length=1, max_length=SHORT,
                         description="UID of the engine pod this mark is about; a replacement pod is unmarked.")
    dead: str | None = Field(None, min_length=1, max_length=SHORT,
                             description="Set: the orchestrator found the pod dead (the cause, e.g. probe_failed); "
                             "the operator recreates the slot within the restart budget.")
    dead_message: str | None = Field(None, max_length=MESSAGE, description="Why it is dead.")
    weight_version: str | None = Field(None, max_length=SHORT, description="Weight version read back from the pod.")


class OrchestratorMarks(ApiModel):
    """The part of a fleet's status written by its run's orchestrator (the trainer pod), never by the operator.

    The trainer may patch only the status of fleets and runs, never a spec or a pod: these marks are how
    it tells the operator what it found.
    """

    model_path: str | None = Field(None, min_length=1, max_length=PATH,
                                   description="Snapshot replacement engines start from (a directory under the "
                                   "fleet's snapshots.mountPath; anything else is not used).")
    weight_version: str | None = Field(None, max_length=SHORT, description="Weight version of that snapshot.")
    engines: dict[str, EngineMark] = Field(
        default_factory=dict, max_length=4096, description="Marks per engine slot (the key is the slot number).")


class OrchestratorFailure(ApiModel):
    """The run's orchestrator failed the run (written by the trainer pod; the operator adopts it as Failed)."""

    reason: str = Field(..., min_length=1, max_length=1024, description="e.g. RolloutEnginesUnavailable.")
    message: str = Field("", max_length=MESSAGE, description="Details, e.g. the engines' last log lines.")


class TrainerStatus(ApiModel):
    """The run's trainer: its recreations within spec.trainer.maxRestarts (written by the operator) and its
    torch.distributed ranks (written by the trainer pod)."""

    restarts: int = Field(0, ge=0, description="Trainer pods recreated after a failure (spec.trainer.maxRestarts).")
    failures: int = Field(0, ge=0, description="Trainer failures seen; one more than restarts while a "
                          "recreation waits out its backoff.")
    last_failure: FailureStatus | None = Field(None, description="The trainer pod's most recent failure: exit code "
                                               "and its last log lines.")
    ranks: int | None = Field(None, ge=1, description="Ranks of the trainer (tensor x pipeline x data parallel).")
    ready: int | None = Field(None, ge=0, description="Ranks that joined the trainer's process group and train; "
                              "0 once a rank has failed (the group stops as one).")
    layout_checked: bool | None = Field(
        None, description="The trainer pod read the model and found that spec.trainer's tensor and pipeline "
        "parallel sizes fit it (heads, kv heads, vocab, ffn, layers). A run that splits the model gets its fleets "
        "only then, so a layout the model cannot take fails the run before any engine starts.")


class TrainingRunStatus(ApiModel):
    """What a TrainingRun is doing."""

    phase: RunPhase | None = Field(None, description="Lifecycle phase.")
    message: str | None = Field(None, max_length=MESSAGE, description="Why the run is in its phase.")
    step: int | None = Field(None, ge=0, description="Training steps completed.")
    weight_version: str | None = Field(None, max_length=SHORT, description="Weight version the rollout engines serve.")
    reward_mean: float | None = Field(None, description="Mean reward of the last step.")
    ready_engines: int | None = Field(None, ge=0, description="Rollout engines serving.")
    total_engines: int | None = Field(None, ge=0, description="Rollout engine slots.")
    ready: str | None = Field(None, max_length=32, description="ready/total engines, for kubectl get.")
    engine_restarts: int | None = Field(None, ge=0, description="Engine recreations in this run, all slots.")
    rollout_replicas: int | None = Field(None, ge=0, description="Rollout engine pods that exist (the scale "
                                         "subresource: `kubectl scale tr` sets spec.rollout.replicas).")
    rollout_selector: str | None = Field(None, max_length=1024,
                                         description="Label selector of the rollout engine pods (scale subresource).")
    engines: list[EngineSlotStatus] = Field(
        default_factory=list, max_length=4096, description="Rollout engine slots.", json_schema_extra=SLOT_LIST
    )
    conditions: list[Condition] = Field(
        default_factory=list, max_length=8, description="Ready, Progressing, Degraded, Failed.",
        json_schema_extra=CONDITION_LIST
    )
    last_eval: LastEvalStatus | None = Field(None, description="Most recent evaluation point.")
    trainer: TrainerStatus | None = Field(None, description="The trainer: its ranks, how many are ready, and the "
                                          "trainer pod's failures and recreations.")
    orchestrator_failure: OrchestratorFailure | None = Field(
        None, description="Written by the run's orchestrator only: why it failed the run (the operator makes it "
        "the Failed condition).")
    start_time: Timestamp | None = Field(None, description="When training started.")
    completion_time: Timestamp | None = Field(None, description="When the run ended.")
    observed_generation: int | None = Field(None, ge=0, description="The spec generation this status describes.")

    @model_validator(mode="after")
    def _fill_ready(self):
        if self.ready is None and self.ready_engines is not None and self.total_engines is not None:
            self.ready = ready_text(self.ready_engines, self.total_engines)
        return self


class FleetStatus(ApiModel):
    """What a fleet's engine slots are doing."""

    replicas: int | None = Field(None, ge=0, description="Engine slots that exist (scale subresource).")
    ready_replicas: int | None = Field(None, ge=0, description="Engines serving.")
    selector: str | None = Field(None, max_length=1024,
                                 description="Label selector of the engine pods (scale subresource).")
    weight_version: str | None = Field(None, max_length=SHORT,
                                       description="Version every ready engine reported; unset when they differ.")
    restarts: int | None = Field(None, ge=0,
                                 description="Recreations in this fleet, all slots (the per-run budget counts these).")
    engines: list[EngineSlotStatus] = Field(
        default_factory=list, max_length=4096, description="Engine slots.", json_schema_extra=SLOT_LIST
    )
    conditions: list[Condition] = Field(
        default_factory=list, max_length=8, description="Ready, Progressing, Degraded, Failed.",
        json_schema_extra=CONDITION_LIST
    )
    observed_generation: int | None = Field(None, ge=0, description="The spec generation this status describes.")
    orchestrator: OrchestratorMarks | None = Field(
        None, description="Written by the run's orchestrator only: dead marks, read-back versions, the snapshot "
        "replacements start from.")


class RolloutFleetStatus(FleetStatus):
    """Status of a RolloutFleet."""


class EvalFleetStatus(FleetStatus):
    """Status of an EvalFleet."""

    pinned_version: str | None = Field(None, max_length=SHORT, description="Snapshot version the fleet is pinned to.")
    pinned_snapshot: str | None = Field(None, max_length=PATH, description="Snapshot directory the fleet is pinned to.")
