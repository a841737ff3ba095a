"""Evaluation settings of a TrainingRun, and the eval fleet's effective engine spec.

The eval fleet inherits the rollout engine spec; every engine field may be overridden on its own
(the `--eval-sglang-*` idea). When the eval fleet's tensor-parallel size differs from the rollout
engines', the settings coupled to it (pipeline, data and expert parallelism) fall back to 1 unless
overridden too, because SGLang refuses combinations such as `tp=1 ep=8` at start-up.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, create_model

from rlfleet.crds.fleet_specs import MIN_READY_RULE, RouterSpec
from rlfleet.crds.rules import Rule, only_when
from rlfleet.crds.specs import (
    NODE_SELECTOR_RULE,
    PATH,
    ApiModel,
    EngineSpec,
    HealthSpec,
    RecoverySpec,
    engine_gpus_needed,
)

_IMPORT_PATH = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_.]*"
IMPORT_PATH_PATTERN = f"^{_IMPORT_PATH}$"  # module.path:object
# The trainer's built-in tasks (rlfleet.trainer.tasks.TASKS; a unit test keeps the two equal).
BUILTIN_TASKS = ("copy", "reverse", "rotate")
TASK_PATTERN = f"^({'|'.join(BUILTIN_TASKS)}|{_IMPORT_PATH})$"  # a built-in name or an import path
DATASET_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$"

# Engine fields that only make sense together with the tensor-parallel size they were chosen for.
TP_COUPLED_FIELDS = ("pipeline_parallel_size", "data_parallel_size", "expert_parallel_size")
# Fields the eval fleet never takes from overrides: it evaluates the run's own model.
NOT_OVERRIDABLE = ("model_path",)


def _override_fields() -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for name, info in EngineSpec.model_fields.items():
        if name in NOT_OVERRIDABLE:
            continue
        inner: Any = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        description = (info.description or "").rstrip(".")
        fields[name] = (
            inner | None,
            Field(None, description=(description + ". " if description else "") + "Unset: the rollout engine's value."),
        )
    return fields


EngineOverridesSpec = create_model(
    "EngineOverridesSpec",
    __base__=ApiModel,
    __doc__=(
        "Per-field overrides of the rollout engine spec for the eval fleet. Unset fields are inherited; when "
        "tensorParallelSize differs from the rollout engines', pipelineParallelSize, dataParallelSize and "
        "expertParallelSize fall back to 1; on cuda, gpusPerEngine unset here is the GPUs the eval engine's layout "
        "uses (tensorParallelSize x pipelineParallelSize x dataParallelSize), or the rollout engines' when they "
        "run the same tensorParallelSize on cuda with more."
    ),
    __module__=__name__,
    **_override_fields(),
)


# The rules of EngineSpec on a value that a pod gets directly (the override's own node selector keys).
EngineOverridesSpec.cel_rules = (
    Rule(
        cel=f"!has(self.nodeSelector) || {NODE_SELECTOR_RULE.cel}",
        check=lambda s: s.node_selector is None or NODE_SELECTOR_RULE.check(s),
        field=NODE_SELECTOR_RULE.field,
        message=NODE_SELECTOR_RULE.message,
    ),
)


def effective_eval_engine(rollout: EngineSpec, overrides: ApiModel) -> EngineSpec:
    """The eval engine spec: the rollout engine's, with overrides and the TP-coupled fallback applied."""
    chosen = {name: value for name, value in overrides if value is not None}
    merged = rollout.model_dump()
    merged.update(chosen)
    tp_changed = merged["tensor_parallel_size"] != rollout.tensor_parallel_size
    if tp_changed:
        for name in TP_COUPLED_FIELDS:
            if name not in chosen:
                merged[name] = 1
    if "gpus_per_engine" not in chosen and merged["device"] == "cpu" and rollout.device == "cuda":
        merged["gpus_per_engine"] = 0  # a cpu eval engine of a cuda rollout fleet asks for no GPU
    if "gpus_per_engine" not in chosen and merged["device"] == "cuda":
        # Unset here, an eval engine on cuda asks for the GPUs its own layout uses (the rollout engines'
        # count when they run the same tensor-parallel size on cuda and it suffices).
        needed = engine_gpus_needed(EngineSpec.model_construct(**merged))
        inherited = rollout.gpus_per_engine if rollout.device == "cuda" and not tp_changed else 0
        merged["gpus_per_engine"] = max(needed, inherited)
    return EngineSpec.model_validate(merged)


DEFAULT_INPUT_KEY = "prompt"
DEFAULT_LABEL_KEY = "answer"


class EvalDatasetSpec(ApiModel):
    """One evaluation dataset: a JSONL file of prompts and answers, or a built-in task."""

    name: str = Field(..., min_length=1, max_length=63, pattern=DATASET_NAME_PATTERN,
                      description="Name of the scores and metrics.")
    path: str | None = Field(
        None, min_length=1, max_length=PATH,
        description="JSONL file, one object per line with the prompt and the expected answer (relative paths: "
        "from the manifest's directory locally, from the snapshot volume in pods).",
    )
    task: str | None = Field(
        None, max_length=256, pattern=TASK_PATTERN,
        description="A built-in task name (e.g. reverse) or an import path module:object, used instead of a file.",
    )
    input_key: str = Field(DEFAULT_INPUT_KEY, min_length=1, max_length=64,
                           description="JSONL key of the prompt (path).")
    label_key: str = Field(DEFAULT_LABEL_KEY, min_length=1, max_length=64,
                           description="JSONL key of the expected answer (path).")
    max_prompts: int | None = Field(
        None, ge=1, le=10_000_000, description="Evaluate only the first N prompts; unset: all of a file, 64 of a task."
    )
    samples_per_prompt: int = Field(1, ge=1, le=1024,
                                    description="Samples per prompt; the score is the mean reward of all samples.")
    max_new_tokens: int | None = Field(None, ge=1, le=1_000_000, description="Unset: the trainer's maxNewTokens.")
    temperature: float | None = Field(
        None, ge=0, le=10, description="Unset: greedy (0) with one sample per prompt, else the trainer's temperature."
    )
    top_p: float | None = Field(None, gt=0, le=1, description="Unset: the trainer's topP.")
    reward_function: str | None = Field(
        None, max_length=256, pattern=IMPORT_PATH_PATTERN,
        description="Scoring function module:function; unset: the trainer's rewardFunction, else the reward of "
        "this dataset's task (a JSONL file: of the trainer's task), as training rewards."
    )

    cel_rules = (
        Rule(
            cel="has(self.path) != has(self.task)",
            check=lambda s: (s.path is None) != (s.task is None),
            field="path",
            message="set exactly one of path and task",
        ),
        *(only_when(field, attribute, default, when_cel="has(self.path)", when=lambda s: s.path is not None,
                    message=f"{field} names a key of a JSONL file (path): a task makes its own prompts; remove it")
          for field, attribute, default in (("inputKey", "input_key", DEFAULT_INPUT_KEY),
                                            ("labelKey", "label_key", DEFAULT_LABEL_KEY))),
    )


class EvalFleetTemplateSpec(ApiModel):
    """The dedicated eval fleet (posture fleet): the operator creates an EvalFleet from it."""

    replicas: int = Field(1, ge=1, le=4096, description="Number of eval engines.")
    min_ready_engines: int = Field(1, ge=1, le=4096, description="Evaluate only when at least this many engines serve.")
    engine: EngineOverridesSpec = Field(default_factory=EngineOverridesSpec)
    health: HealthSpec | None = Field(None, description="Unset: the rollout fleet's health settings.")
    recovery: RecoverySpec | None = Field(None, description="Unset: the rollout fleet's recovery settings.")
    router: RouterSpec | None = Field(None, description="Unset: the rollout fleet's router settings.")

    cel_rules = (MIN_READY_RULE,)


class ExternalEvalSpec(ApiModel):
    """A user evaluator (posture external): a CheckpointEvalFn class that gets each snapshot directory."""

    class_path: str = Field(
        ..., max_length=256, pattern=IMPORT_PATH_PATTERN,
        description="Import path module:Class of a CheckpointEvalFn subclass.",
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the class, passed as given.")


DEFAULT_EVAL_KEEP = 2
DEFAULT_PIN_TIMEOUT_S = 600.0
DEFAULT_PIN_RETRIES = 2
DEFAULT_ROUTER_PROBE_TIMEOUT_S = 180.0


class EvalSpec(ApiModel):
    """Evaluation during fully-async training, always on a pinned weight version."""

    posture: Literal["shared", "fleet", "external"] = Field(
        "shared",
        description="shared: pause the producer and evaluate on the rollout engines; fleet: a dedicated EvalFleet "
        "pinned to a snapshot; external: a user CheckpointEvalFn class given the snapshot directory.",
    )
    interval_steps: int = Field(10, ge=1, le=10_000_000,
                                description="Evaluate every N training steps (the final step always).")
    eval_before_train: bool = Field(True, description="Evaluate the initial model before the first step.")
    datasets: list[EvalDatasetSpec] = Field(
        default_factory=list, max_length=16, description="What to evaluate (required unless posture is external)."
    )
    max_in_flight: int = Field(2, ge=1, le=64, description="Evaluation points pending at once.")
    overflow_policy: Literal["backpressure", "skip"] = Field(
        "backpressure",
        description="When maxInFlight points are pending: backpressure waits for the oldest; skip records a busy skip.",
    )
    keep_snapshots: int = Field(DEFAULT_EVAL_KEEP, ge=1, le=100,
                                description="Consumed eval snapshots kept on the volume (postures fleet and external; "
                                "shared evaluates the live weights and writes none).")
    pin_timeout_seconds: float = Field(
        DEFAULT_PIN_TIMEOUT_S, ge=1, le=86400,
        description="Bound on loading a snapshot on every eval engine and reading the version back (posture "
        "fleet)."
    )
    pin_retries: int = Field(DEFAULT_PIN_RETRIES, ge=1, le=10,
                             description="Attempts to pin the eval fleet before the point is skipped pin_violation "
                             "(posture fleet).")
    router_probe_timeout_seconds: float = Field(
        DEFAULT_ROUTER_PROBE_TIMEOUT_S, ge=1, le=3600,
        description="Bound on admitting the pinned engines to the eval router and on the one-token probe through "
        "it, each (posture fleet)."
    )
    fleet: EvalFleetTemplateSpec | None = Field(
        None, description="The dedicated eval fleet (posture fleet); unset settings are the rollout fleet's."
    )
    external: ExternalEvalSpec | None = Field(None, description="The user evaluator (posture external).")

    cel_rules = (
        Rule(
            cel="self.posture != 'fleet' || has(self.fleet)",
            check=lambda s: s.posture != "fleet" or s.fleet is not None,
            field="fleet",
            message="posture fleet requires a fleet spec",
        ),
        Rule(
            cel="!has(self.fleet) || self.posture == 'fleet'",
            check=lambda s: s.fleet is None or s.posture == "fleet",
            field="fleet",
            message="fleet is used only with posture fleet",
        ),
        Rule(
            cel="self.posture != 'external' || has(self.external)",
            check=lambda s: s.posture != "external" or s.external is not None,
            field="external",
            message="posture external requires external.classPath",
        ),
        Rule(
            cel="!has(self.external) || self.posture == 'external'",
            check=lambda s: s.external is None or s.posture == "external",
            field="external",
            message="external is used only with posture external",
        ),
        Rule(
            cel="self.posture == 'external' || size(self.datasets) > 0",
            check=lambda s: s.posture == "external" or len(s.datasets) > 0,
            field="datasets",
            message="datasets must name at least one dataset unless posture is external",
        ),
        *(only_when(field, attribute, default, when_cel="self.posture == 'fleet'", when=lambda s: s.posture == "fleet",
                    message=f"{field} bounds the pinning of an eval fleet: it is read with posture fleet only; "
                    "remove it")
          for field, attribute, default in (
              ("pinTimeoutSeconds", "pin_timeout_seconds", DEFAULT_PIN_TIMEOUT_S),
              ("pinRetries", "pin_retries", DEFAULT_PIN_RETRIES),
              ("routerProbeTimeoutSeconds", "router_probe_timeout_seconds", DEFAULT_ROUTER_PROBE_TIMEOUT_S))),
        only_when("keepSnapshots", "keep_snapshots", DEFAULT_EVAL_KEEP, when_cel="self.posture != 'shared'",
                  when=lambda s: s.posture != "shared",
                  message="keepSnapshots counts eval snapshots: posture shared evaluates the live weights and "
                  "writes none; remove it"),
        Rule(
            cel="self.datasets.all(d, self.datasets.exists_one(e, e.name == d.name))",
            check=lambda s: len({d.name for d in s.datasets}) == len(s.datasets),
            field="datasets",
            message="dataset names must be unique",
        ),
    )
