"""String tasks: deterministic prompts, answers, rewards, import-path plugins, the JSONL eval format."""
from __future__ import annotations

import itertools
import sys
import types

import pytest

from rlfleet.trainer.tasks import (
    Problem,
    ProblemStream,
    TaskSpec,
    exact_match,
    load_reward_fn,
    load_task,
    positional_match,
)


def test_prompts_are_deterministic_by_seed():
    spec = TaskSpec("reverse", min_len=3, max_len=4)
    assert ProblemStream(spec, 7).take(20) == ProblemStream(spec, 7).take(20)
    assert ProblemStream(spec, 7).take(20) != ProblemStream(spec, 8).take(20)


def test_words_use_the_alphabet_and_lengths():
    spec = TaskSpec("copy", alphabet="xyz", min_len=2, max_len=4)
    problems = ProblemStream(spec, 0).take(200)
    words = [p.prompt[:-1] for p in problems]
    assert all(p.prompt.endswith("=") for p in problems)
    assert {len(w) for w in words} == {2, 3, 4}
    assert set("".join(words)) == set("xyz")


@pytest.mark.parametrize("name, word, answer", [
    ("reverse", "abcd", "dcba"), ("copy", "abcd", "abcd"), ("rotate", "abcd", "bcda"),
])
def test_answers(name, word, answer):
    assert TaskSpec(name).problem(word) == Problem(f"{word}=", answer)


def test_bad_task_specs_are_refused():
    with pytest.raises(ValueError, match="unknown task"):
        TaskSpec("sort")
    with pytest.raises(ValueError, match="alphabet"):
        TaskSpec("copy", alphabet="aab")
    with pytest.raises(ValueError, match="min_len"):
        TaskSpec("copy", min_len=3, max_len=2)


def test_positional_reward_gives_partial_credit():
    assert positional_match("abc=", "cba", "cba") == 1.0
    assert positional_match("abc=", "cbx", "cba") == pytest.approx(2 / 3)
    assert positional_match("abc=", "c", "cba") == pytest.approx(1 / 3)
    assert positional_match("abc=", "acb", "cba") == 0.0
    assert positional_match("abc=", "cba and more", "cba") == 1.0


def test_exact_reward_needs_the_whole_answer():
    assert exact_match("abc=", "cba", "cba") == 1.0
    assert exact_match("abc=", "cbx", "cba") == 0.0


def test_reward_functions_load_by_import_path():
    assert load_reward_fn("rlfleet.trainer.tasks:exact_match") is exact_match
    # A dotted attribute (the API's pattern accepts module:Class.method) is looked up part by part.
    assert load_reward_fn("rlfleet.trainer.tasks:ProblemStream.take") is ProblemStream.take
    for bad, message in [("rlfleet.trainer.tasks", "module:object"), ("no.such.module:f", "cannot import"),
                         ("rlfleet.trainer.tasks:nothing", "has no 'nothing'"),
                         ("rlfleet.trainer.tasks:ProblemStream.nothing", "has no 'ProblemStream.nothing'"),
                         ("rlfleet.trainer.tasks:TASKS", "not callable")]:
        with pytest.raises(ValueError, match=message):
            load_reward_fn(bad)


def test_builtin_task_streams_problems_with_its_reward():
    task = load_task("rotate")
    first = list(itertools.islice(task.problems(3), 5))
    assert first == ProblemStream(TaskSpec("rotate"), 3).take(5)
    assert task.reward is positional_match


def test_plugin_task_by_import_path(monkeypatch):
    module = types.ModuleType("user_task_module")

    def arithmetic(seed):
        for i in range(3):
            yield (f"{seed}+{i}=", str(seed + i)) if i % 2 else {"prompt": f"{seed}+{i}=", "answer": str(seed + i)}

    arithmetic.reward = exact_match
    module.arithmetic = arithmetic
    monkeypatch.setitem(sys.modules, "user_task_module", module)
    task = load_task("user_task_module:arithmetic")
    assert list(task.problems(5)) == [Problem("5+0=", "5"), Problem("5+1=", "6"), Problem("5+2=", "7")]
    assert task.reward is exact_match
