"""Specs of engine fleets: the rollout template of a TrainingRun and the RolloutFleet/EvalFleet specs."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import Field

from rlfleet.crds import k8s_values as kv
from rlfleet.crds.conventions import FOLLOWER_HEALTH_PORT, ROUTER_METRICS_PORT
from rlfleet.crds.rules import Rule
from rlfleet.crds.specs import (
    DEFAULT_WAIT_ALL_ALIVE_S,
    IMAGE,
    MOUNT_PATH_RULE,
    PATH,
    SHORT,
    ApiModel,
    EngineSpec,
    HealthSpec,
    RecoverySpec,
)

DEFAULT_ROUTER_RESTARTS = 5


class RouterSpec(ApiModel):
    """The sglang-router in front of a fleet. A run's trainer decides its members (the engines that serve the
    run's weights); in a fleet of no run's router pod, `rlfleet follow-engines` routes to its Ready engine pods."""

    image: str = Field(
        "lmsysorg/sglang:v0.5.23", max_length=IMAGE, pattern=kv.IMAGE,
        description="Container image of the router pod, providing `python -m sglang_router.launch_router` (a local "
        "run uses the installed sglang-router).",
    )
    port: int = Field(30000, ge=1024, le=65535,
                      description="Port the router listens on in its pod (a local run picks a free port).")
    policy: Literal["cache_aware", "round_robin", "random", "power_of_two"] = Field(
        "cache_aware",
        description="Load-balancing policy. cache_aware keeps a prompt's group of samples on one engine's "
        "prefix cache.",
    )
    health_check_interval_seconds: int = Field(
        2, ge=1, le=3600,
        description="The router's own health-check interval (sglang-router --health-check-interval-secs)."
    )
    health_failure_threshold: int = Field(
        2, ge=1, le=100, description="Failed router health checks before it stops routing to an engine."
    )
    max_restarts: int = Field(
        DEFAULT_ROUTER_RESTARTS, ge=0, le=1000,
        description="Router restarts allowed per run (local runs restart the process, with the fleet's recovery "
        "backoff; on Kubernetes, router pod replacements and in-place container restarts the trainer follows). "
        "One more fails the run.",
    )

    cel_rules = (
        Rule(
            cel=f"self.port != {ROUTER_METRICS_PORT} && self.port != {FOLLOWER_HEALTH_PORT}",
            check=lambda s: s.port not in (ROUTER_METRICS_PORT, FOLLOWER_HEALTH_PORT),
            field="port",
            message=f"ports {ROUTER_METRICS_PORT} and {FOLLOWER_HEALTH_PORT} are taken in the router pod (its "
                    "metrics, its engine follower's health); choose another",
        ),
    )


MIN_READY_RULE = Rule(
    cel="self.minReadyEngines <= self.replicas",
    check=lambda s: s.min_ready_engines <= s.replicas,
    field="minReadyEngines",
    message="minReadyEngines must not exceed replicas",
)

# A fleet scaled to zero is switched off, whatever its minimum (`kubectl scale --replicas=0` works).
FLEET_MIN_READY_RULE = Rule(
    cel="self.replicas == 0 || self.minReadyEngines <= self.replicas",
    check=lambda s: s.replicas == 0 or s.min_ready_engines <= s.replicas,
    field="minReadyEngines",
    message="minReadyEngines must not exceed replicas (unless the fleet is scaled to 0)",
)


class EngineTemplateSpec(EngineSpec):
    """The rollout engine of a TrainingRun; the model path defaults to the run's modelPath."""

    # Optional here, required on EngineSpec: the run's modelPath fills it in (rlfleet.crds.derive).
    model_path: str | None = Field(  # type: ignore[assignment]  # a subclass field may be unset
        None, min_length=1, max_length=PATH,
        description="Model served at start: the TrainingRun's modelPath (the engines serve the model the trainer "
        "trains; any other value is refused).",
    )


class RolloutTemplateSpec(ApiModel):
    """The rollout fleet of a TrainingRun: the operator creates a RolloutFleet from it."""

    replicas: int = Field(
        1, ge=1, le=4096,
        description="Number of rollout engines. May change while the run runs (kubectl patch/apply/edit): the "
        "fleet follows; an added engine gets the current weights at the first weight sync after it is Ready, "
        "before the router sends it work; a removed one leaves the router at once.",
    )
    min_ready_engines: int = Field(
        1, ge=1, le=4096,
        description="The run goes on while at least this many engines serve; below it, it waits and recovers. "
        "May change while the run runs."
    )
    engine: EngineTemplateSpec = Field(default_factory=EngineTemplateSpec)
    health: HealthSpec = Field(default_factory=HealthSpec)
    recovery: RecoverySpec = Field(default_factory=RecoverySpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    request_timeout_seconds: float = Field(
        600.0, ge=1, le=86400, description="Deadline of one rollout request, retries included."
    )
    max_retries: int = Field(
        3, ge=0, le=100,
        description="Retries of a rollout request that failed (no connection, a timeout, 5xx, 408, 429 or an "
        "abort), with backoff, never a fixed-interval storm; an attempt that produced tokens and is continued "
        "does not count."
    )
    concurrency_per_engine: int = Field(
        64, ge=1, le=4096, description="Rollout requests in flight per engine, in whole GRPO groups (at least "
        "one group, at most one step's)."
    )
    continuation: bool = Field(
        True,
        description="A generation whose engine died, left the router or aborted it continues on another "
        "engine from the tokens it had (streamed; prompt + prefix, the remaining budget, the same sampling "
        "settings); false: it starts again from scratch.",
    )

    cel_rules: ClassVar[tuple[Rule, ...]] = (MIN_READY_RULE,)
    # Fields a running run follows (the operator scales its RolloutFleet, the trainer's orchestrator follows
    # the fleet); the rest is read by the trainer and the engines when they start.
    LIVE_FIELDS: ClassVar[frozenset[str]] = frozenset({"replicas", "min_ready_engines"})


class SnapshotMountSpec(ApiModel):
    """The run's snapshot volume as a fleet's pods mount it."""

    claim_name: str = Field(..., min_length=1, max_length=SHORT, pattern=kv.DNS1123_SUBDOMAIN,
                            description="PersistentVolumeClaim (ReadWriteMany).")
    mount_path: str = Field("/snapshots", max_length=PATH, pattern=kv.MOUNT_PATH,
                            description="Mount path in engine pods.")

    cel_rules = (MOUNT_PATH_RULE,)


def run_only(field: str, value: Callable[[Any], float], default: float, message: str) -> Rule:
    """A fleet field only a run's orchestrator uses: a fleet without runName leaves it at `default`."""
    return Rule(
        cel=f"has(self.runName) || self.{field} == {default!r}",  # an int field compares with an int
        check=lambda s: s.run_name is not None or value(s) == default,
        field=field,
        message=message,
    )


# What only a run's orchestrator does: a fleet of no run has none to do it. (field, its value, default, why)
RUN_ONLY_FIELDS: tuple[tuple[str, Callable[[Any], float], float, str], ...] = (
    ("health.firstWaitSeconds", lambda s: s.health.first_wait_seconds, 0.0,
     "firstWaitSeconds is the wait after a run's orchestrator resumes an engine it paused: a fleet of no "
     "run (no runName) is never paused; leave it 0"),
    ("recovery.waitAllAliveTimeoutSeconds", lambda s: s.recovery.wait_all_alive_timeout_seconds,
     DEFAULT_WAIT_ALL_ALIVE_S, "waitAllAliveTimeoutSeconds bounds a run's wait for its engines before a "
     f"weight sync: a fleet of no run (no runName) has no weight sync; leave it unset "
     f"({DEFAULT_WAIT_ALL_ALIVE_S:g})"),
    ("router.maxRestarts", lambda s: s.router.max_restarts, DEFAULT_ROUTER_RESTARTS,
     "maxRestarts counts the router replacements a run's trainer follows: the router Deployment of a "
     "fleet of no run (no runName) is restarted by Kubernetes; "
     f"leave it unset ({DEFAULT_ROUTER_RESTARTS})"),
)


def run_only_fields_set(spec: Any) -> list[str]:
    """The run-only fields of a fleet spec set to other than their defaults (what a fleet of no run ignores)."""
    return [field for field, value, default, _ in RUN_ONLY_FIELDS if value(spec) != default]


class FleetSpec(ApiModel):
    """A fleet of SGLang engines behind one router, one pod per slot."""

    replicas: int = Field(1, ge=0, le=4096, description="Number of engine slots (the scale subresource sets it).")
    min_ready_engines: int = Field(
        1, ge=0, le=4096, description="The fleet is Ready with at least this many engines serving; at least 1 "
        "while replicas > 0 (0 is for a fleet scaled to 0)."
    )
    engine: EngineSpec
    health: HealthSpec = Field(default_factory=HealthSpec)
    recovery: RecoverySpec = Field(default_factory=RecoverySpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    run_name: str | None = Field(None, max_length=40, pattern=kv.DNS1035_LABEL,
                                 description="The TrainingRun this fleet belongs to: set by the operator on the "
                                 "fleets a run creates (their only client is its trainer). It counts only on a "
                                 "fleet that run owns (its controller): a fleet created by anyone else is a fleet "
                                 "of no run whatever runName says, and the fields only a run uses (they must "
                                 "otherwise be left at their defaults) have no effect on it.")
    snapshots: SnapshotMountSpec | None = Field(None, description="Shared snapshot volume mounted in every engine pod.")

    cel_rules = (
        FLEET_MIN_READY_RULE,
        *(run_only(*field) for field in RUN_ONLY_FIELDS),
    )


class RolloutFleetSpec(FleetSpec):
    """Rollout engines whose weights follow the trainer."""


class EvalFleetSpec(FleetSpec):
    """Evaluation engines, pinned to one snapshot at a time."""
