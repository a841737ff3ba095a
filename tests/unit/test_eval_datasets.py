"""Eval datasets resolved from a TrainingRun's eval spec: JSONL files, tasks, sampling defaults."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from rlfleet.crds.eval_specs import EvalDatasetSpec
from rlfleet.crds.models import TrainerSpec
from rlfleet.orchestrator.evaluation.datasets import DatasetError, read_jsonl_problems, resolve_dataset
from rlfleet.snapshot.volume import default_local_volume, is_scratch_volume
from rlfleet.trainer.tasks import positional_match

TRAINER = TrainerSpec(max_new_tokens=16, temperature=0.7, top_p=0.9)


def test_a_jsonl_dataset_with_its_own_keys_relative_to_the_manifest(tmp_path):
    rows = [{"question": "ab=", "solution": "ba"}, {"question": "abc=", "solution": "cba"}]
    (tmp_path / "set.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    spec = EvalDatasetSpec(name="mine", path="set.jsonl", input_key="question", label_key="solution", max_prompts=1)
    dataset = resolve_dataset(spec, TRAINER, base_dir=tmp_path, stop_token_ids=[2])
    assert dataset.problems == (("ab=", "ba"),)
    # One sample per prompt is greedy; lengths and top_p come from the trainer.
    assert dataset.sampling_params() == {"max_new_tokens": 16, "temperature": 0.0, "top_p": 0.9, "stop_token_ids": [2]}
    assert dataset.reward_fn is positional_match


def test_a_built_in_task_is_a_fixed_set_apart_from_training_prompts():
    spec = EvalDatasetSpec(name="reverse", task="reverse", max_prompts=8, samples_per_prompt=4)
    first = resolve_dataset(spec, TRAINER)
    again = resolve_dataset(spec, TRAINER)
    assert len(first.problems) == 8 and first.problems == again.problems
    assert all(answer == prompt[:-1][::-1] for prompt, answer in first.problems)
    assert first.temperature == 0.7 and first.samples_per_prompt == 4


@pytest.mark.parametrize("content, message", [
    ("", "no problems"),
    ("{not json}\n", ":1: not JSON"),
    ('{"prompt": "a="}\n', ':1: expected an object with string "prompt" and "answer"'),
])
def test_bad_jsonl_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        read_jsonl_problems(path)


def test_missing_files_unknown_tasks_and_bad_rewards_name_the_problem(tmp_path):
    with pytest.raises(DatasetError, match="No such file"):
        resolve_dataset(EvalDatasetSpec(name="x", path="missing.jsonl"), TRAINER, base_dir=tmp_path)
    with pytest.raises(ValidationError, match="task"):  # the API refuses a task that is no built-in name
        EvalDatasetSpec(name="x", task="sorting")
    with pytest.raises(DatasetError, match="unknown task"):  # and the resolver still names it
        resolve_dataset(EvalDatasetSpec.model_construct(name="x", task="sorting"), TRAINER)
    with pytest.raises(DatasetError, match="dataset x"):
        resolve_dataset(EvalDatasetSpec(name="x", task="reverse", reward_function="no_such_mod:f"), TRAINER)


def test_the_local_volume_is_on_tmpfs_when_there_is_room(tmp_path):
    roomy = tmp_path / "shm"
    roomy.mkdir()
    chosen = default_local_volume(tmp_path / "run-1", tmpfs=roomy, min_free_bytes=1)
    assert chosen.parent == roomy / "rlfleet" and chosen.name.startswith("run-1-")
    assert default_local_volume(tmp_path / "run-1", tmpfs=roomy, min_free_bytes=1) == chosen
    assert default_local_volume(tmp_path / "run-2", tmpfs=roomy, min_free_bytes=1) != chosen
    assert default_local_volume(tmp_path / "run-1", tmpfs=roomy,
                                min_free_bytes=2**62) == tmp_path / "run-1" / "snapshots"
    assert default_local_volume(tmp_path / "run-1", tmpfs=tmp_path / "absent") == tmp_path / "run-1" / "snapshots"
    assert is_scratch_volume(chosen, tmpfs=roomy) and not is_scratch_volume(tmp_path / "run-1" / "snapshots",
                                                                            tmpfs=roomy)
