"""Where a local run's CUDA processes run: the trainer's ranks and every engine on GPUs of their own.

On Kubernetes each pod sees only the GPUs it asked for. A local run (`rlfleet run FILE`) shares one
machine's GPUs, and SGLang starts every engine on GPU 0 unless told otherwise: two engines, or an
engine and the trainer, would share a GPU (and a broadcast weight sync over NCCL needs a GPU per rank).
So the GPUs are handed out in order: the trainer's ranks first (local rank i trains on GPU i), then each
rollout engine slot its `gpusPerEngine`, then each eval engine slot. A slot keeps its GPUs: the engine
that replaces a dead one starts on them again. Pure: the number of visible GPUs is an argument.

    plan = plan_local_gpus(spec, eval_fleet_spec(name, spec))
    check_local_gpus(plan, visible=torch.cuda.device_count())   # ValueError naming the fields
    plan.rollout[slot]                                          # that engine's --base-gpu-id
"""
from __future__ import annotations

from dataclasses import dataclass

from rlfleet.crds.fleet_specs import EvalFleetSpec
from rlfleet.crds.models import TrainingRunSpec
from rlfleet.crds.specs import EngineSpec


@dataclass(frozen=True)
class LocalGpuPlan:
    trainer: range  # the trainer's GPUs (empty on CPU)
    rollout: tuple[int, ...]  # the first GPU of each rollout engine slot (empty: CPU engines)
    evaluation: tuple[int, ...]  # the first GPU of each eval engine slot
    gpus_per_rollout_engine: int = 0
    gpus_per_eval_engine: int = 0

    @property
    def needed(self) -> int:
        return (len(self.trainer) + len(self.rollout) * self.gpus_per_rollout_engine
                + len(self.evaluation) * self.gpus_per_eval_engine)

    def describe(self) -> str:
        parts = []
        if self.trainer:
            parts.append(f"trainer {_span(self.trainer.start, len(self.trainer))}")
        for what, bases, per in (("rollout engine", self.rollout, self.gpus_per_rollout_engine),
                                 ("eval engine", self.evaluation, self.gpus_per_eval_engine)):
            parts += [f"{what} {slot} {_span(base, per)}" for slot, base in enumerate(bases)]
        return ", ".join(parts)


def _span(first: int, count: int) -> str:
    return f"GPU {first}" if count == 1 else f"GPUs {first}-{first + count - 1}"


def _engine_gpus(engine: EngineSpec) -> int:
    return engine.gpus_per_engine if engine.device == "cuda" else 0


def plan_local_gpus(spec: TrainingRunSpec, eval_fleet: EvalFleetSpec | None = None) -> LocalGpuPlan:
    """The GPUs of the trainer and of every engine slot of a local run, in that order."""
    trainer = range(spec.trainer.gpus)  # a local run has one node: gpus is the whole world on CUDA
    per_rollout = _engine_gpus(spec.rollout.engine)
    after = len(trainer)
    rollout = tuple(after + slot * per_rollout for slot in range(spec.rollout.replicas)) if per_rollout else ()
    after += len(rollout) * per_rollout
    per_eval = _engine_gpus(eval_fleet.engine) if eval_fleet is not None else 0
    evaluation = (tuple(after + slot * per_eval for slot in range(eval_fleet.replicas))
                  if eval_fleet is not None and per_eval else ())
    return LocalGpuPlan(trainer=trainer, rollout=rollout, evaluation=evaluation,
                        gpus_per_rollout_engine=per_rollout, gpus_per_eval_engine=per_eval)


def local_gpu_problems(plan: LocalGpuPlan, visible: int) -> list[str]:
    """Why the plan cannot run on a machine with `visible` GPUs (one message naming the fields), or []."""
    if plan.needed <= visible:
        return []
    asks = []
    if plan.trainer:
        asks.append(f"spec.trainer.gpus {len(plan.trainer)}")
    if plan.rollout:
        asks.append(f"spec.rollout.replicas {len(plan.rollout)} x spec.rollout.engine.gpusPerEngine "
                    f"{plan.gpus_per_rollout_engine}")
    if plan.evaluation:
        asks.append(f"spec.eval.fleet.replicas {len(plan.evaluation)} x gpusPerEngine {plan.gpus_per_eval_engine}")
    return [f"a local run gives the trainer and every CUDA engine GPUs of their own: {' + '.join(asks)} = "
            f"{plan.needed} GPUs, but this machine has {visible} visible (CUDA_VISIBLE_DEVICES)"]


def check_local_gpus(plan: LocalGpuPlan, visible: int) -> None:
    problems = local_gpu_problems(plan, visible)
    if problems:
        raise ValueError("; ".join(problems))
