"""Small verifiable string tasks, reward functions, and the eval dataset format.

A tiny byte-level model learns these from scratch with RL on two CPU cores. A problem is a prompt
such as `"abc="` and its answer (`"cba"` for `reverse`); the response is scored character by
character.

- Prompts are deterministic by seed (`ProblemStream(task, seed)`).
- Reward functions are plain callables `fn(prompt, response, answer) -> float`, named by import
  path (`"rlfleet.trainer.tasks:positional_match"`) so users can plug in their own.
- Eval datasets are JSONL files with one `{"prompt": ..., "answer": ...}` object per line.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rlfleet.util.imports import ImportPathError, import_object

RewardFn = Callable[[str, str, str], float]
DEFAULT_REWARD = "rlfleet.trainer.tasks:positional_match"


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def _reverse(word: str, alphabet: str) -> str:
    return word[::-1]


def _copy(word: str, alphabet: str) -> str:
    return word


def _rotate(word: str, alphabet: str) -> str:
    """Each letter replaced by the next one in the alphabet (cyclic)."""
    return "".join(alphabet[(alphabet.index(c) + 1) % len(alphabet)] for c in word)


# name -> answer(word, alphabet)
TASKS: dict[str, Callable[[str, str], str]] = {"reverse": _reverse, "copy": _copy, "rotate": _rotate}


@dataclass(frozen=True)
class TaskSpec:
    """A task: which transformation, over which letters, on words of which lengths."""

    name: str = "reverse"
    alphabet: str = "abcd"
    min_len: int = 3
    max_len: int = 3

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ValueError(f"unknown task {self.name!r}: expected one of {sorted(TASKS)}")
        if not self.alphabet or len(set(self.alphabet)) != len(self.alphabet) or "=" in self.alphabet:
            raise ValueError(f"alphabet must be distinct characters other than '=', got {self.alphabet!r}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {self.min_len}..{self.max_len}")

    def answer(self, word: str) -> str:
        return TASKS[self.name](word, self.alphabet)

    def problem(self, word: str) -> Problem:
        return Problem(prompt=f"{word}=", answer=self.answer(word))


class ProblemStream:
    """An endless, seed-deterministic sequence of problems."""

    def __init__(self, spec: TaskSpec, seed: int):
        self.spec = spec
        self._rng = random.Random(seed)

    def next_problem(self) -> Problem:
        length = self._rng.randint(self.spec.min_len, self.spec.max_len)
        word = "".join(self._rng.choice(self.spec.alphabet) for _ in range(length))
        return self.spec.problem(word)

    def take(self, count: int) -> list[Problem]:
        return [self.next_problem() for _ in range(count)]


# --- rewards --------------------------------------------------------------------------------


def positional_match(prompt: str, response: str, answer: str) -> float:
    """Fraction of the answer's characters found at their position in the response.

    Partial credit gives a random-init model a gradient long before it gets a whole answer right.
    Text after the answer's length is ignored (max_new_tokens bounds it).
    """
    if not answer:
        raise ValueError("empty answer")
    return sum(1 for a, b in zip(answer, response, strict=False) if a == b) / len(answer)


def exact_match(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response begins with the whole answer, else 0.0."""
    return 1.0 if response[: len(answer)] == answer else 0.0


def load_reward_fn(path: str) -> RewardFn:
    """Import `package.module:function`; it is called as fn(prompt, response, answer) -> float."""
    return _import_object(path, "reward function")


def _import_object(path: str, what: str) -> Callable:
    try:
        obj = import_object(path)
    except ImportPathError as exc:
        raise ValueError(f"{what}: {exc}") from exc
    if not callable(obj):
        raise ValueError(f"{what}: {path!r} is not callable")
    return obj


# --- task resolution ------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """A prompt source and its own reward: what a TrainingRun's `task` names."""

    name: str
    problems: Callable[[int], Iterator[Problem]]  # seed -> endless (or finite) problems
    reward: RewardFn


def load_task(task: str) -> Task:
    """A built-in task name (reverse, copy, rotate) or an import path `module:object`.

    The imported object is called with the seed and returns an iterable of problems (`Problem`,
    `(prompt, answer)` or `{"prompt", "answer"}`); its `reward` attribute, when present, is the
    task's own reward (else positional_match).
    """
    if ":" not in task:
        spec = TaskSpec(name=task)
        return Task(name=task, problems=lambda seed: _endless(ProblemStream(spec, seed)), reward=positional_match)
    factory = _import_object(task, "task")
    reward = getattr(factory, "reward", None) or positional_match
    if not callable(reward):
        raise ValueError(f"task {task!r} has a reward attribute that is not callable")
    return Task(name=task, problems=lambda seed: (_as_problem(p, task) for p in factory(seed)), reward=reward)


def _endless(stream: ProblemStream) -> Iterator[Problem]:
    while True:
        yield stream.next_problem()


def _as_problem(item: object, task: str) -> Problem:
    if isinstance(item, Problem):
        return item
    if isinstance(item, dict) and isinstance(item.get("prompt"), str) and isinstance(item.get("answer"), str):
        return Problem(item["prompt"], item["answer"])
    if isinstance(item, tuple) and len(item) == 2 and all(isinstance(x, str) for x in item):
        return Problem(*item)
    raise ValueError(f"task {task!r} produced {item!r}: expected a Problem, (prompt, answer) or a dict")


def eval_problems(spec: TaskSpec, count: int, seed: int = 1_000_003) -> list[Problem]:
    """A fixed eval set for a task (a seed far from the training streams')."""
    return ProblemStream(spec, seed).take(count)
