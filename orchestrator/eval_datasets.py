"""Eval datasets: a TrainingRun's `eval.datasets` resolved into prompts, answers and sampling settings.

A dataset is either a JSONL file (one object per line with the prompt and the expected answer, under
`inputKey` / `labelKey`) or a task: a built-in name (e.g. `reverse`, a fixed problem set far from the
training stream's seed) or an import path `module:object` to a callable `f(count) -> [(prompt, answer)]`.
Unset sampling settings come from the trainer: greedy with one sample per prompt, the trainer's
temperature otherwise.
"""
from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rlfleet.crds.eval_specs import EvalDatasetSpec
from rlfleet.crds.models import TrainerSpec

DEFAULT_TASK_PROMPTS = 64
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
        params = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p}
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return params


class DatasetError(ValueError):
    """A dataset cannot be read; the message names the dataset and the problem."""


def read_jsonl_problems(path: str | os.PathLike, input_key: str = "prompt", label_key: str = "answer") -> list[tuple[str, str]]:
    """Read a JSONL eval set; blank lines are skipped, anything else malformed is an error."""
    problems: list[tuple[str, str]] = []
    try:
        handle = open(path, encoding="utf-8")
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
            if not isinstance(row, dict) or not isinstance(row.get(input_key), str) or not isinstance(row.get(label_key), str):
                raise DatasetError(f'{path}:{number}: expected an object with string "{input_key}" and "{label_key}"')
            problems.append((row[input_key], row[label_key]))
    if not problems:
        raise DatasetError(f"{path}: no problems")
    return problems


def _import(path: str, what: str):
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise DatasetError(f"cannot import {what} module {module_name!r}: {exc}") from exc
    obj = getattr(module, attr, None)
    if obj is None:
        raise DatasetError(f"{module_name!r} has no {attr!r} ({what})")
    return obj


def task_problems(task: str, count: int) -> list[tuple[str, str]]:
    if ":" in task:
        source = _import(task, "task")
        if not callable(source):
            raise DatasetError(f"task {task!r} is not callable")
        rows = list(source(count))
    else:
        from rlfleet.trainer.tasks import TaskSpec, eval_problems

        try:
            spec = TaskSpec(name=task)
        except ValueError as exc:
            raise DatasetError(str(exc)) from None
        rows = [(p.prompt, p.answer) for p in eval_problems(spec, count)]
    problems = []
    for row in rows:
        prompt, answer = (row.prompt, row.answer) if hasattr(row, "prompt") else row
        problems.append((str(prompt), str(answer)))
    if not problems:
        raise DatasetError(f"task {task!r} produced no problems")
    return problems[:count]


def resolve_dataset(spec: EvalDatasetSpec, trainer: TrainerSpec, *, base_dir: Path | None = None,
                    stop_token_ids: Sequence[int] = ()) -> EvalDataset:
    from rlfleet.trainer.tasks import DEFAULT_REWARD, load_reward_fn

    if spec.path is not None:
        path = Path(spec.path)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        problems = read_jsonl_problems(path, spec.input_key, spec.label_key)
        if spec.max_prompts is not None:
            problems = problems[: spec.max_prompts]
    else:
        problems = task_problems(spec.task or "", spec.max_prompts or DEFAULT_TASK_PROMPTS)
    reward_path = spec.reward_function or trainer.reward_function or DEFAULT_REWARD
    try:
        reward_fn = load_reward_fn(reward_path)
    except ValueError as exc:
        raise DatasetError(f"dataset {spec.name}: {exc}") from None
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
