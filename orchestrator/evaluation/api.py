"""The evaluator contract: a snapshot directory in, results out.

Users plug their own evaluation in (posture `external`) with a subclass of `CheckpointEvalFn`:

    class MyEval(CheckpointEvalFn):
        max_concurrent_points = 2            # points it may evaluate at once (default 1)

        async def evaluate_checkpoint(self, checkpoint_dir, request):
            ...                              # load checkpoint_dir, generate, score
            return {"my-dataset": 0.73}      # or an EvalOutcome with per-dataset details

        async def dispose(self):             # optional (may be sync): stop what __init__ started
            ...

`checkpoint_dir` is a sealed Hugging Face snapshot of training step `request.step` (safetensors,
config, tokenizer; its `.complete` marker and checksums were checked before the call). Raise
`EvalSkip("reason")` to record the point as skipped with that reason instead of crashed; any other
exception records it as `crashed`. Neither ever stops training. The directory belongs to the run:
read it, do not keep it (it is deleted once newer points settle, keepSnapshots newest stay).
"""
from __future__ import annotations

import abc
import inspect
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.orchestrator.evaluation.policy import DatasetScore
from rlfleet.util.imports import ImportPathError, import_object

REASON_MAX = 64


class EvalSkip(Exception):
    """Skip this evaluation point with a reason (a short word: busy, unhealthy, judge_down, ...)."""

    def __init__(self, reason: str, detail: str = "", *, engine_versions: Mapping[str, str] | None = None):
        reason = str(reason).strip()
        if not reason or len(reason) > REASON_MAX or any(c.isspace() for c in reason):
            raise ValueError(f"an EvalSkip reason is one short word (at most {REASON_MAX} characters), got {reason!r}")
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.engine_versions = dict(engine_versions or {})  # what each engine reported, when known


@dataclass(frozen=True)
class EvalRequest:
    """What to evaluate at one point."""

    run: str
    step: int  # the training step the point belongs to
    weight_version: str  # "<step>": the version engines must report for this snapshot
    datasets: tuple[Any, ...] = ()  # rlfleet.orchestrator.evaluation.datasets.EvalDataset, from the run's spec
    checkpoint_dir: Path | None = None  # None for posture shared (no snapshot)


@dataclass
class EvalOutcome:
    """A point's results: per-dataset scores, the version measured and what each engine reported."""

    weight_version: str
    datasets: dict[str, DatasetScore] = field(default_factory=dict)
    engine_versions: dict[str, str] = field(default_factory=dict)


class CheckpointEvalFn(abc.ABC):
    """Base class of a user evaluator (posture external)."""

    max_concurrent_points: int = 1

    @abc.abstractmethod
    async def evaluate_checkpoint(self, checkpoint_dir: str, request: EvalRequest) -> EvalOutcome | Mapping[str, Any]:
        """Evaluate the snapshot in checkpoint_dir; return an EvalOutcome or {dataset: score}."""

    def dispose(self) -> Any:
        """Release what __init__ or evaluate_checkpoint started (may be a coroutine function)."""
        return None


class EvaluatorLoadError(ValueError):
    pass


def load_checkpoint_eval_fn(class_path: str, args: Mapping[str, Any] | None = None, *,
                            search_dirs: Sequence[Path] = ()) -> CheckpointEvalFn:
    """Import `module:Class`, check it is a CheckpointEvalFn and instantiate it with `args` as given.

    `search_dirs` (the manifest's directory for `rlfleet run`) are looked in after sys.path, so a class
    next to the manifest is found.
    """
    return instantiate_checkpoint_eval_fn(import_checkpoint_eval_class(class_path, search_dirs=search_dirs),
                                          class_path, args)


def import_checkpoint_eval_class(class_path: str, *, search_dirs: Sequence[Path] = ()) -> type[CheckpointEvalFn]:
    """Import `module:Class` and check it is a CheckpointEvalFn subclass (blocking: imports user code)."""
    for directory in search_dirs:
        if str(directory) not in sys.path:
            sys.path.append(str(directory))
    try:
        cls = import_object(class_path)
    except ImportPathError as exc:
        raise EvaluatorLoadError(f"external.classPath {exc}") from exc
    if not (inspect.isclass(cls) and issubclass(cls, CheckpointEvalFn)):
        raise EvaluatorLoadError(f"{class_path} is not a CheckpointEvalFn subclass")
    return cls


def instantiate_checkpoint_eval_fn(cls: type[CheckpointEvalFn], class_path: str,
                                   args: Mapping[str, Any] | None = None) -> CheckpointEvalFn:
    """`cls(**args)`, checked (run it on the event loop: a constructor may create loop-bound objects)."""
    try:
        instance = cls(**dict(args or {}))
    except TypeError as exc:
        raise EvaluatorLoadError(f"{class_path}({', '.join(args or {})}): {exc}") from exc
    concurrent = getattr(instance, "max_concurrent_points", 1)
    if not isinstance(concurrent, int) or concurrent < 1:
        raise EvaluatorLoadError(f"{class_path}.max_concurrent_points must be an integer >= 1, got {concurrent!r}")
    return instance
