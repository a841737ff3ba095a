"""The three kinds of the rlfleet API: TrainingRun, RolloutFleet and EvalFleet.

`KINDS` also holds what the CRDs need beyond the schema (names, printer columns, subresources), so
`rlfleet.crds.generate` derives everything from this module.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

from pydantic import ConfigDict, Field

from rlfleet.crds import API_VERSION, GROUP, VERSION
from rlfleet.crds import k8s_values as kv
from rlfleet.crds.conventions import TRAINER_RENDEZVOUS_PORT, UPDATE_GROUP_PORT
from rlfleet.crds.eval_specs import IMPORT_PATH_PATTERN, TASK_PATTERN, EvalSpec
from rlfleet.crds.fleet_specs import EvalFleetSpec, RolloutFleetSpec, RolloutTemplateSpec
from rlfleet.crds.rules import Rule, fixed_except, immutable
from rlfleet.crds.specs import (
    DP_ATTENTION_FLAG,
    IMAGE,
    NODE_SELECTOR_RULE,
    PATH,
    ApiModel,
    CheckpointSpec,
    EnvVarSpec,
    HeatGuardSpec,
    LabelValue,
    ResourcesSpec,
    TolerationSpec,
    TrackingSpec,
    WatchdogSpec,
    WeightSyncSpec,
)
from rlfleet.crds.status import EvalFleetStatus, RolloutFleetStatus, TrainingRunStatus

_WORLD_CEL = "self.tensorParallelSize * self.pipelineParallelSize * self.dataParallelSize"
TINY_MODEL_PATTERN = r"^tiny://(llama|qwen2|qwen3)(\?seed=[0-9]{1,9})?$"
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# Runs and fleets name Services (`<fleet>-router`): DNS-1035 labels, a letter first.
SERVICE_NAME_PATTERN = kv.DNS1035_LABEL
# Child objects are named <run>-rollout, <run>-eval-router, ...: keep room for the longest suffix
# within the 63 characters of a label value.
MAX_RUN_NAME = 40
# A fleet's name is a label value (`rlfleet.io/fleet`) and, with `-router`, a Service name (63).
MAX_FLEET_NAME = 56
# Samples per step (promptsPerStep x samplesPerPrompt) beyond which a step cannot be held in memory.
MAX_SAMPLES_PER_STEP = 1_000_000


class TrainerSpec(ApiModel):
    """The trainer: backend, resources, and the RL hyper-parameters of the loop."""

    backend: Literal["megatron", "torch"] = Field(
        "torch",
        description="megatron: megatron-core GPTModel (GPU clusters); torch: a Hugging Face transformers model "
        "(CPU or GPU).",
    )
    image: str | None = Field(None, max_length=IMAGE, pattern=kv.IMAGE,
                              description="Container image of the trainer pod; unset: the operator's trainer image "
                              "(the chart's trainerImage).")
    gpus: int = Field(
        1, ge=0, le=1024,
        description="GPUs of each trainer node, one rank per GPU; 0 trains on CPU (one process per rank, gloo).",
    )
    nodes: int = Field(
        1, ge=1, le=1024,
        description="Nodes the trainer's ranks span: 1 is one trainer pod `<run>-trainer`; more is a group of pods "
        "`<run>-trainer-<i>` (one per node, i = 0 .. nodes-1) that rendezvous on pod 0, fail and restart as one. "
        "Each pod runs gpus ranks (gpus x nodes = the world), or on CPU world / nodes (the world must be a "
        "multiple of nodes). Immutable.",
    )
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="Megatron tensor-model parallelism.")
    pipeline_parallel_size: int = Field(1, ge=1, le=64, description="Megatron pipeline-model parallelism.")
    data_parallel_size: int = Field(
        1, ge=1, le=1024,
        description="Data-parallel replicas; the trainer is tensorParallelSize x pipelineParallelSize x "
        "dataParallelSize torch.distributed ranks, each step's batch split across the replicas.",
    )
    data_parallel_mode: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="How the torch backend's data-parallel replicas hold the model: ddp keeps the whole weights, "
        "gradients and AdamW moments on every replica and sums the gradients (DistributedDataParallel); fsdp "
        "(PyTorch FSDP2, fully_shard) shards all three across the replicas, about 1/dataParallelSize of them on "
        "each, and gathers a layer's weights for its forward and backward passes. fsdp needs backend torch and "
        "dataParallelSize above 1 (megatron shards its optimizer across the replicas itself on GPUs).",
    )
    steps: int = Field(100, ge=1, le=10_000_000, description="Training steps (one weight version each).")
    prompts_per_step: int = Field(32, ge=1, le=1_000_000, description="Prompts sampled per step (the rollout batch).")
    samples_per_prompt: int = Field(
        8, ge=2, le=1024, description="Samples per prompt: the group whose rewards are normalised together (GRPO)."
    )
    micro_batch_size: int | None = Field(None, ge=1, le=1_000_000,
                                         description="Samples per forward/backward pass; unset: the whole step.")
    max_new_tokens: int = Field(1024, ge=1, le=1_000_000, description="Longest rollout response.")
    temperature: float = Field(1.0, ge=0, le=10, description="Rollout sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Rollout nucleus sampling.")
    learning_rate: float = Field(1e-6, gt=0, le=1, description="Optimizer learning rate.")
    eps_clip: float = Field(0.2, gt=0, lt=1, description="PPO-style ratio clipping: the ratio is kept within "
                            "[1 - epsClip, 1 + epsClip].")
    kl_coef: float = Field(
        0.0, ge=0, le=100,
        description="Weight of the KL penalty (k3 estimator, token mean) to the initial model in the loss; "
        "above 0 the trainer keeps a frozen copy of the initial weights (0: off).",
    )
    grad_clip: float = Field(1.0, ge=0, le=1e6, description="Gradient norm clip (0: off).")
    max_staleness: int = Field(
        1, ge=0, le=1000,
        description="A step trains only on samples generated at most this many weight versions ago (0: on-policy).",
    )
    staleness_by: Literal["oldest", "newest"] = Field(
        "oldest",
        description="Which token's weight version judges the staleness of a sample generated under several "
        "(continued after a weight sync): the oldest or the newest.",
    )
    task: str = Field(
        "reverse", max_length=256, pattern=TASK_PATTERN,
        description="Prompt source: a built-in task name (e.g. reverse) or an import path module:object.",
    )
    reward_function: str | None = Field(
        None, max_length=256, pattern=IMPORT_PATH_PATTERN,
        description="Reward function module:function; unset: the task's own."
    )
    seed: int = Field(0, ge=0, le=2**31 - 1,
                      description="Seed of the prompts' order, the trainer's initialisation and retry jitter (the "
                      "engines' token sampling is not seeded).")
    max_restarts: int = Field(
        3, ge=0, le=1000,
        description="Kubernetes: times the operator recreates a trainer pod that failed or vanished for a reason "
        "the run did not report itself (not a fleet's crash loop, a watchdog trip or an invalid spec), after an "
        "exponential backoff (10 s, 20 s, ... up to 5 min); the recreated pod resumes from the newest complete "
        "checkpoint (spec.checkpoint; without one it starts again from step 0) beside the running engines. "
        "0: never. Past it the run fails with the trainer's last log lines. A local run (`rlfleet run`) has no "
        "trainer pod: a value other than 0 is refused there (resume a stopped local run with --resume).",
    )
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    node_selector: dict[str, LabelValue] = Field(default_factory=dict, max_length=32,
                                                 description="Pod node selector (pods only).")
    tolerations: list[TolerationSpec] = Field(default_factory=list, max_length=32,
                                              description="Pod tolerations (pods only).")
    env: list[EnvVarSpec] = Field(default_factory=list, max_length=128, description="Extra environment variables.")

    cel_rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.backend == 'megatron' || (self.tensorParallelSize == 1 && self.pipelineParallelSize == 1)",
            check=lambda s: s.backend == "megatron" or (s.tensor_parallel_size == 1 and s.pipeline_parallel_size == 1),
            field="tensorParallelSize",
            message="model parallelism needs backend megatron",
        ),
        Rule(
            cel="self.dataParallelMode == 'ddp' || (self.backend == 'torch' && self.dataParallelSize > 1)",
            check=lambda s: s.data_parallel_mode == "ddp" or (s.backend == "torch" and s.data_parallel_size > 1),
            field="dataParallelMode",
            message="dataParallelMode fsdp shards the torch backend's data-parallel replicas: it needs backend "
            "torch and dataParallelSize above 1",
            detail=lambda s: f"dataParallelMode fsdp shards the torch backend's data-parallel replicas: it needs "
            f"backend torch and dataParallelSize above 1 (backend is {s.backend}, dataParallelSize "
            f"{s.data_parallel_size})",
        ),
        Rule(
            cel="self.gpus == 0 || self.gpus * self.nodes == " + _WORLD_CEL,
            check=lambda s: s.gpus == 0 or s.gpus * s.nodes == s.world_size,
            field="gpus",
            message="gpus x nodes must equal tensorParallelSize x pipelineParallelSize x dataParallelSize "
            "(one rank per GPU)",
            detail=lambda s: f"gpus x nodes ({s.gpus} x {s.nodes} = {s.gpus * s.nodes}) must equal "
            f"tensorParallelSize x pipelineParallelSize x dataParallelSize ({s.tensor_parallel_size} x "
            f"{s.pipeline_parallel_size} x {s.data_parallel_size} = {s.world_size}): one rank per GPU",
        ),
        Rule(
            cel="self.promptsPerStep * self.samplesPerPrompt >= self.dataParallelSize",
            check=lambda s: s.prompts_per_step * s.samples_per_prompt >= s.data_parallel_size,
            field="dataParallelSize",
            message="every data-parallel replica needs a sample of each step: promptsPerStep x samplesPerPrompt "
            "must be at least dataParallelSize",
            detail=lambda s: f"every data-parallel replica needs a sample of each step: promptsPerStep x "
            f"samplesPerPrompt ({s.prompts_per_step} x {s.samples_per_prompt} = "
            f"{s.prompts_per_step * s.samples_per_prompt}) must be at least dataParallelSize "
            f"({s.data_parallel_size})",
        ),
        Rule(
            # With GPUs the rule above fixes a pod's ranks (gpus); on CPU a pod runs world / nodes ranks.
            cel="self.gpus > 0 || (" + _WORLD_CEL + ") % self.nodes == 0",
            check=lambda s: s.gpus > 0 or s.world_size % s.nodes == 0,
            field="nodes",
            message="on CPU (gpus: 0) every trainer pod runs the same number of ranks: tensorParallelSize x "
            "pipelineParallelSize x dataParallelSize must be a multiple of nodes",
            detail=lambda s: f"on CPU (gpus: 0) every trainer pod runs the same number of ranks: "
            f"tensorParallelSize x pipelineParallelSize x dataParallelSize ({s.tensor_parallel_size} x "
            f"{s.pipeline_parallel_size} x {s.data_parallel_size} = {s.world_size}) must be a multiple of nodes "
            f"({s.nodes})",
        ),
        NODE_SELECTOR_RULE,
        Rule(
            cel=f"self.promptsPerStep * self.samplesPerPrompt <= {MAX_SAMPLES_PER_STEP}",
            check=lambda s: s.prompts_per_step * s.samples_per_prompt <= MAX_SAMPLES_PER_STEP,
            field="promptsPerStep",
            message=f"promptsPerStep x samplesPerPrompt must not exceed {MAX_SAMPLES_PER_STEP:,} samples per step",
        ),
        immutable("backend", "backend", "trainer backend"),
        # The trainer group's pods are named and ranked by node: a run keeps its group's size.
        immutable("nodes", "nodes", "trainer nodes"),
    )
    # Fields the operator applies to a running run (the rest is read by the trainer pods when they start).
    LIVE_FIELDS: ClassVar[frozenset[str]] = frozenset({"max_restarts"})

    @property
    def world_size(self) -> int:
        """Ranks of the trainer: tensor x pipeline x data parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def splits_model(self) -> bool:
        """Tensor or pipeline parallel: the model's dimensions must fit the layout, which only a trainer that
        reads the model can check (on Kubernetes the trainer pod, before the operator creates the fleets)."""
        return self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1

    @property
    def ranks_per_node(self) -> int:
        """Ranks of each trainer pod: one per GPU, or on CPU an equal share of the world."""
        return self.gpus if self.gpus > 0 else self.world_size // self.nodes


# A run's trainer pods and orchestrator read the spec when they start; an edit would reach them only at a
# recreation (mid-run, against a checkpoint of the old layout), so what they read is fixed at creation.
FIXED_MESSAGE = ("{what} is fixed once the run exists: the run's trainer and orchestrator read it when they start "
                 "(create a new TrainingRun to change it)")
TrainerSpec.cel_rules = (*TrainerSpec.cel_rules, fixed_except(
    TrainerSpec, TrainerSpec.LIVE_FIELDS | {"backend", "nodes"},
    message=FIXED_MESSAGE.format(what="spec.trainer (all but maxRestarts)")))
RolloutTemplateSpec.cel_rules = (*RolloutTemplateSpec.cel_rules, fixed_except(
    RolloutTemplateSpec, RolloutTemplateSpec.LIVE_FIELDS,
    message=FIXED_MESSAGE.format(what="spec.rollout (all but replicas and minReadyEngines)")))


class TrainingRunSpec(ApiModel):
    """An RL post-training run: a trainer, its rollout fleet, and optional evaluation."""

    model_path: str = Field(
        ..., min_length=1, max_length=PATH,
        description="Initial model: a Hugging Face model directory (on the snapshot volume in pods; nothing is "
        "downloaded from the hub), or tiny://llama?seed=N (also tiny://qwen2, tiny://qwen3) for the project's tiny "
        "offline model, generated on first use.",
    )
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    rollout: RolloutTemplateSpec = Field(default_factory=RolloutTemplateSpec)
    watchdog: WatchdogSpec = Field(default_factory=WatchdogSpec)
    heat_guard: HeatGuardSpec = Field(default_factory=HeatGuardSpec)
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec)
    eval: EvalSpec | None = Field(
        None, description="Evaluation during training, always on a pinned weight version; unset: no evaluation."
    )
    metrics_port: int = Field(9400, ge=1024, le=65535, description="Port of the run's Prometheus metrics.")
    checkpoint: CheckpointSpec | None = Field(
        None, description="Trainer checkpoints (model, optimizer, RNG, data position, eval state), written "
        "atomically beside training; unset: none, and a stopped run starts again from step 0.",
    )
    tracking: TrackingSpec | None = Field(
        None, description="Trackers of the per-step record (TensorBoard, MLflow, Weights & Biases); unset: the run "
        "summary only.",
    )

    cel_rules = (
        Rule(
            cel="!self.modelPath.startsWith('tiny://') || self.modelPath.matches('"
            + TINY_MODEL_PATTERN.replace("\\", "\\\\") + "')",
            check=lambda s: (not s.model_path.startswith("tiny://")
                             or re.match(TINY_MODEL_PATTERN, s.model_path) is not None),
            field="modelPath",
            message="a tiny model path reads tiny://llama, tiny://qwen2 or tiny://qwen3, optionally with ?seed=N",
        ),
        Rule(
            cel="self.weightSync.mode != 'broadcast' "
            "|| ((self.trainer.gpus > 0) == (self.rollout.engine.device == 'cuda'))",
            check=lambda s: (s.weight_sync.mode != "broadcast"
                             or (s.trainer.gpus > 0) == (s.rollout.engine.device == "cuda")),
            field="weightSync.mode",
            message="weight sync mode broadcast needs the trainer and the engines on the same kind of device "
            "(GPU trainer with cuda engines: nccl; CPU trainer with cpu engines: gloo); use disk",
        ),
        # SGLang places each engine process in the update group at rank offset + its tensor-parallel rank
        # alone: pipeline stages, and data-parallel replicas that do not share the tensor-parallel ranks,
        # would all claim the same ranks, and no broadcast could ever start.
        Rule(
            cel="self.weightSync.mode != 'broadcast' || self.rollout.engine.pipelineParallelSize == 1",
            check=lambda s: s.weight_sync.mode != "broadcast" or s.rollout.engine.pipeline_parallel_size == 1,
            field="rollout.engine.pipelineParallelSize",
            message="weight sync mode broadcast cannot reach an engine of several pipeline stages: SGLang ranks its "
            "processes in the update group by tensor-parallel rank alone, so the stages would collide; use disk",
        ),
        Rule(
            cel="self.weightSync.mode != 'broadcast' || self.rollout.engine.dataParallelSize == 1"
            f" || self.rollout.engine.extraArgs.exists(a, a == '{DP_ATTENTION_FLAG}')",
            check=lambda s: (s.weight_sync.mode != "broadcast" or s.rollout.engine.data_parallel_size == 1
                             or DP_ATTENTION_FLAG in s.rollout.engine.extra_args),
            field="rollout.engine.dataParallelSize",
            message="weight sync mode broadcast cannot reach an engine of several data-parallel replicas: SGLang "
            "ranks its processes in the update group by tensor-parallel rank alone, so the replicas would collide "
            f"(unless they share the tensor-parallel ranks, {DP_ATTENTION_FLAG}); use disk, or more engines",
        ),
        Rule(
            cel=f"self.weightSync.mode != 'broadcast' || self.metricsPort != {UPDATE_GROUP_PORT}",
            check=lambda s: s.weight_sync.mode != "broadcast" or s.metrics_port != UPDATE_GROUP_PORT,
            field="metricsPort",
            message=f"port {UPDATE_GROUP_PORT} is the trainer pod's update-group port in weight sync mode "
            "broadcast; choose another",
        ),
        Rule(
            cel=f"self.trainer.nodes == 1 || self.metricsPort != {TRAINER_RENDEZVOUS_PORT}",
            check=lambda s: s.trainer.nodes == 1 or s.metrics_port != TRAINER_RENDEZVOUS_PORT,
            field="metricsPort",
            message=f"port {TRAINER_RENDEZVOUS_PORT} is the trainer group's rendezvous port when "
            "spec.trainer.nodes > 1; choose another",
        ),
        Rule(
            cel="!has(self.rollout.engine.modelPath) || self.rollout.engine.modelPath == self.modelPath",
            check=lambda s: s.rollout.engine.model_path in (None, s.model_path),
            field="rollout.engine.modelPath",
            message="the rollout engines serve the model the trainer trains: leave rollout.engine.modelPath unset "
            "(it is spec.modelPath)",
        ),
        Rule(
            cel="!self.heatGuard.enabled || !(self.heatGuard.source.type in ['nvml', 'dcgm', 'prometheus']) "
            "|| self.rollout.engine.device == 'cuda'",
            check=lambda s: (not s.heat_guard.enabled
                             or s.heat_guard.source.type not in ("nvml", "dcgm", "prometheus")
                             or s.rollout.engine.device == "cuda"),
            field="heatGuard.source.type",
            message="nvml, dcgm and prometheus read the engines' GPU temperatures: spec.rollout.engine.device must "
            "be cuda (use file for cpu engines)",
        ),
        immutable("modelPath", "model_path"),
        *(immutable(alias, name, message=FIXED_MESSAGE.format(what=f"spec.{alias}")) for name, alias in (
            ("watchdog", "watchdog"), ("heat_guard", "heatGuard"),
            ("weight_sync", "weightSync"), ("eval", "eval"), ("metrics_port", "metricsPort"),
            ("checkpoint", "checkpoint"), ("tracking", "tracking"))),
    )


class ObjectMeta(ApiModel):
    """The parts of Kubernetes object metadata the loader checks; the rest passes through."""

    model_config = ConfigDict(extra="allow")

    name: str | None = Field(None, max_length=253, pattern=NAME_PATTERN)
    generate_name: str | None = Field(None, max_length=253)
    namespace: str | None = Field(None, max_length=63, pattern=NAME_PATTERN)
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class RunMeta(ObjectMeta):
    """TrainingRun metadata: the name is shorter, its children's names add a suffix to it."""

    name: str | None = Field(None, max_length=MAX_RUN_NAME, pattern=SERVICE_NAME_PATTERN)


class FleetMeta(ObjectMeta):
    """Fleet metadata: the name is a label value and names the router Service."""

    name: str | None = Field(None, max_length=MAX_FLEET_NAME, pattern=SERVICE_NAME_PATTERN)


class _Object(ApiModel):
    api_version: Literal["rlfleet.io/v1alpha1"] = Field(API_VERSION)
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)


class TrainingRun(_Object):
    """An RL post-training run with a fault-tolerant SGLang rollout fleet."""

    metadata: RunMeta = Field(default_factory=RunMeta)
    kind: Literal["TrainingRun"] = "TrainingRun"
    spec: TrainingRunSpec
    status: TrainingRunStatus | None = None


class RolloutFleet(_Object):
    """SGLang rollout engines behind a router; a TrainingRun owns one."""

    metadata: FleetMeta = Field(default_factory=FleetMeta)
    kind: Literal["RolloutFleet"] = "RolloutFleet"
    spec: RolloutFleetSpec
    status: RolloutFleetStatus | None = None


class EvalFleet(_Object):
    """SGLang evaluation engines pinned to weight snapshots; a TrainingRun may own one."""

    metadata: FleetMeta = Field(default_factory=FleetMeta)
    kind: Literal["EvalFleet"] = "EvalFleet"
    spec: EvalFleetSpec
    status: EvalFleetStatus | None = None


@dataclass(frozen=True)
class PrinterColumn:
    name: str
    json_path: str
    type: str
    description: str
    priority: int = 0

    def to_crd(self) -> dict[str, Any]:
        column: dict[str, Any] = {"name": self.name, "type": self.type, "jsonPath": self.json_path,
                                  "description": self.description}
        if self.priority:
            column["priority"] = self.priority
        return column


AGE = PrinterColumn("Age", ".metadata.creationTimestamp", "date", "Time since creation.")


@dataclass(frozen=True)
class ScalePaths:
    """A kind's scale subresource (`kubectl scale`, a HorizontalPodAutoscaler): where the replicas wanted
    are, where those that exist are counted, and the label selector of their pods."""

    spec: str
    status: str
    selector: str

    def describe(self) -> str:
        return ", ".join(path.removeprefix(".") for path in (self.spec, self.status, self.selector))


FLEET_SCALE = ScalePaths(".spec.replicas", ".status.replicas", ".status.selector")
# A run's scale is its rollout fleet's: `kubectl scale tr NAME --replicas=N` sets spec.rollout.replicas.
RUN_SCALE = ScalePaths(".spec.rollout.replicas", ".status.rolloutReplicas", ".status.rolloutSelector")


@dataclass(frozen=True)
class Kind:
    """A kind and its CRD: names, printer columns, subresources, and object-level rules."""

    model: type[_Object]
    plural: str
    short_names: tuple[str, ...]
    columns: tuple[PrinterColumn, ...]
    scale: ScalePaths | None = None

    @property
    def kind(self) -> str:
        return self.model.__name__

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{GROUP}"

    @property
    def spec_model(self) -> type[ApiModel]:
        spec = self.model.model_fields["spec"].annotation
        assert isinstance(spec, type) and issubclass(spec, ApiModel), f"{self.kind}.spec is a model"
        return spec

    @property
    def status_model(self) -> type[ApiModel]:
        status = get_args(self.model.model_fields["status"].annotation)[0]  # `XStatus | None`
        assert isinstance(status, type) and issubclass(status, ApiModel), f"{self.kind}.status is a model"
        return status


CATEGORY = "rlfleet"

_FLEET_COLUMNS = (
    PrinterColumn("Desired", ".spec.replicas", "integer", "Engine slots wanted."),
    PrinterColumn("Ready", ".status.readyReplicas", "integer", "Engines serving."),
)

KINDS: tuple[Kind, ...] = (
    Kind(
        model=TrainingRun,
        plural="trainingruns",
        short_names=("tr",),
        columns=(
            PrinterColumn("Phase", ".status.phase", "string", "Lifecycle phase."),
            PrinterColumn("Step", ".status.step", "integer", "Training steps completed."),
            PrinterColumn("Weights", ".status.weightVersion", "string", "Weight version the rollout engines serve."),
            PrinterColumn("Ready", ".status.ready", "string", "Rollout engines serving / slots."),
            PrinterColumn("Last Eval", ".status.lastEval.summary", "string", "Most recent evaluation point."),
            PrinterColumn("Reward", ".status.rewardMean", "number", "Mean reward of the last step.", priority=1),
            PrinterColumn("Restarts", ".status.engineRestarts", "integer", "Engine recreations.", priority=1),
            AGE,
        ),
        scale=RUN_SCALE,
    ),
    Kind(
        model=RolloutFleet,
        plural="rolloutfleets",
        short_names=("rf",),
        columns=(
            *_FLEET_COLUMNS,
            PrinterColumn("Weights", ".status.weightVersion", "string", "Version every ready engine serves."),
            PrinterColumn("Restarts", ".status.restarts", "integer", "Engine recreations."),
            AGE,
        ),
        scale=FLEET_SCALE,
    ),
    Kind(
        model=EvalFleet,
        plural="evalfleets",
        short_names=("ef",),
        columns=(
            *_FLEET_COLUMNS,
            PrinterColumn("Pinned", ".status.pinnedVersion", "string", "Snapshot version the fleet is pinned to."),
            PrinterColumn("Restarts", ".status.restarts", "integer", "Engine recreations."),
            AGE,
        ),
        scale=FLEET_SCALE,
    ),
)

KINDS_BY_NAME = {k.kind: k for k in KINDS}

__all__ = [
    "API_VERSION", "GROUP", "VERSION", "KINDS", "KINDS_BY_NAME", "Kind", "PrinterColumn",
    "TrainerSpec", "TrainingRunSpec", "TrainingRun", "RolloutFleet", "EvalFleet", "ObjectMeta",
]
