"""Eval datasets: a TrainingRun's `eval.datasets` resolved into prompts, answers and sampling settings.

A dataset is either a JSONL file (one object per line with the prompt and the expected answer, under
`inputKey` / `labelKey`) or a task (`rlfleet.trainer.tasks.load_task`): a built-in name (e.g. `reverse`,
a fixed problem set far from the training stream's seed) or an import path `module:object` (its stream
at the eval seed).
Unset sampling settings come from the trainer: greedy with one sample per prompt, the trainer's
temperature otherwise.
"""
from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.crds.eval_specs import EvalDatasetSpec
from rlfleet.crds.models import TrainerSpec

DEFAULT_TASK_PROMPTS = 64
EVAL_SEED = 1_000_003  # far from the training streams' seeds: eval prompts are not training prompts
RewardFn = Callable[[str, str, str], float]


@dataclass(frozen=True)
class EvalDataset:
    name: str
    problems: tuple[tuple[str, str], ...]  # (prompt, expected answer)
    samples_per_prompt: int
    max_new_tokens: int
    temperature: float
    top_p: float
    reward_fn: RewardFn = field(repr=False, compare=False)
    stop_token_ids: tuple[int, ...] = ()

    def sampling_params(self) -> dict:
        params: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                                  "top_p": self.top_p}
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return params


class DatasetError(ValueError):
    """A dataset cannot be read; the message names the dataset and the problem."""


def read_jsonl_problems(path: str | os.PathLike, input_key: str = "prompt",
                        label_key: str = "answer") -> list[tuple[str, str]]:
    """Read a JSONL eval set; blank lines are skipped, anything else malformed is an error."""
    problems: list[tuple[str, str]] = []
    try:
        handle = open(path, encoding="utf-8")  # noqa: SIM115 - opened apart so that only opening maps to DatasetError
    except OSError as exc:
        raise DatasetError(f"{path}: {exc.strerror or exc}") from None
    with handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{number}: not JSON: {exc.msg}") from None
            if (not isinstance(row, dict) or not isinstance(row.get(input_key), str)
                    or not isinstance(row.get(label_key), str)):
                raise DatasetError(f'{path}:{number}: expected an object with string "{input_key}" and "{label_key}"')
            problems.append((row[input_key], row[label_key]))
    if not problems:
        raise DatasetError(f"{path}: no problems")
    return problems


def task_problems(task: str, count: int) -> list[tuple[str, str]]:
    """`count` problems of a task: built-in tasks use their fixed eval set (a seed far from training's),
    an import path its own stream at that seed."""
    from rlfleet.trainer.tasks import TaskSpec, eval_problems, load_task

    try:
        if ":" in task:
            problems = list(itertools.islice(load_task(task).problems(EVAL_SEED), count))
        else:
            problems = eval_problems(TaskSpec(name=task), count, seed=EVAL_SEED)
    except ValueError as exc:
        raise DatasetError(str(exc)) from None
    if not problems:
        raise DatasetError(f"task {task!r} produced no problems")
    return [(p.prompt, p.answer) for p in problems]


def _reward_fn(spec: EvalDatasetSpec, trainer: TrainerSpec) -> RewardFn:
    """The dataset's reward function, else the trainer's (eval scores what training rewards), else the
    reward of the dataset's task, or of the trainer's task for a JSONL file (what training rewards)."""
    from rlfleet.trainer.tasks import load_reward_fn, load_task

    path = spec.reward_function or trainer.reward_function
    try:
        if path is not None:
            return load_reward_fn(path)
        return load_task(spec.task or trainer.task).reward
    except ValueError as exc:
        raise DatasetError(f"dataset {spec.name}: {exc}") from None


def resolve_dataset(spec: EvalDatasetSpec, trainer: TrainerSpec, *, base_dir: Path | None = None,
                    stop_token_ids: Sequence[int] = ()) -> EvalDataset:
    if spec.path is not None:
        path = Path(spec.path)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        problems = read_jsonl_problems(path, spec.input_key, spec.label_key)
        if spec.max_prompts is not None:
            problems = problems[: spec.max_prompts]
    else:
        problems = task_problems(spec.task or "", spec.max_prompts or DEFAULT_TASK_PROMPTS)
    reward_fn = _reward_fn(spec, trainer)
    if spec.temperature is not None:
        temperature = spec.temperature
    else:
        temperature = 0.0 if spec.samples_per_prompt == 1 else trainer.temperature
    return EvalDataset(
        name=spec.name,
        problems=tuple(problems),
        samples_per_prompt=spec.samples_per_prompt,
        max_new_tokens=spec.max_new_tokens or trainer.max_new_tokens,
        temperature=temperature,
        top_p=spec.top_p if spec.top_p is not None else trainer.top_p,
        reward_fn=reward_fn,
        stop_token_ids=tuple(stop_token_ids),
    )


def resolve_datasets(specs: Sequence[EvalDatasetSpec], trainer: TrainerSpec, *, base_dir: Path | None = None,
                     stop_token_ids: Sequence[int] = ()) -> tuple[EvalDataset, ...]:
    return tuple(resolve_dataset(s, trainer, base_dir=base_dir, stop_token_ids=stop_token_ids) for s in specs)
