"""Trainer checkpoints of both backends: a trainer resumed from step 3 trains on as if it never stopped.

Real trainers on the tiny model; the checkpoint goes through the disk format (shard, marker, checksums).
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from helpers.engines import on_policy_batch
from rlfleet.trainer import checkpoint as ckpt
from rlfleet.trainer.base import build_trainer

PROMPT = list(b"abc=")
RESPONSES = [(list(b"bcd"), 1.0), (list(b"xyz"), 0.0), (list(b"bcx"), 0.5)]


def identity(default_backend: str, **changes) -> ckpt.Identity:
    fields = {"run": "r", "model_path": "tiny://llama", "backend": default_backend, **changes}
    return ckpt.Identity(**fields)


def batches(trainer, n: int) -> list:
    """n on-policy batches, computed up front with the initial weights (so both trainers see the same)."""
    return [on_policy_batch(trainer, PROMPT, RESPONSES[i % 3:] + RESPONSES[:i % 3]) for i in range(n)]


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_resumed_trainer_matches_one_that_never_stopped(backend, tiny_model, tmp_path):
    options = {"lr": 1e-2, "seed": 0, "micro_batch_size": 2}
    straight = build_trainer(backend, tiny_model, **options)
    data = batches(straight, 6)
    for b in data[:3]:
        straight.train_step(b)
    state = ckpt.capture_state(straight)
    random_after_capture = random.random()
    torch_after_capture = torch.rand(3)
    info = ckpt.write_checkpoint(tmp_path, identity=identity(backend), step=3, weight_version="3", state=state,
                                 run_state={"prompts_drawn": 48})
    losses = [straight.train_step(b)["loss"] for b in data[3:]]

    resumed = build_trainer(backend, tiny_model, **options)
    found, skipped = ckpt.newest_complete(tmp_path)
    assert found is not None and found.directory == info.directory and skipped == []
    ckpt.check_identity(found, identity(backend))
    ckpt.restore_state(resumed, ckpt.load_shard(found))
    assert resumed.step == 3 and found.weight_version == "3" and found.run_state() == {"prompts_drawn": 48}
    assert random.random() == random_after_capture and torch.equal(torch.rand(3), torch_after_capture)
    resumed_losses = [resumed.train_step(b)["loss"] for b in data[3:]]
    # Step 4 checks the weights, steps 5 and 6 the optimizer's moments too.
    assert resumed_losses == pytest.approx(losses, abs=1e-5)
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.allclose(resumed.hf_state_dict()[name], straight.hf_state_dict()[name], atol=1e-6)


def test_capture_is_a_copy(tiny_model):
    trainer = build_trainer("torch", tiny_model, lr=1e-2)
    batch = batches(trainer, 1)[0]
    trainer.train_step(batch)
    state = ckpt.capture_state(trainer)
    before = {k: v.clone() for k, v in state["model"].items()}
    trainer.train_step(batch)
    assert all(torch.equal(before[k], state["model"][k]) for k in before)
    assert state["step"] == 1 and state["optimizer"]["state"]
    weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert ckpt.state_bytes(state) >= 3 * weights  # the weights and AdamW's two moments


def small_checkpoint(root, step: int, **identity_changes) -> ckpt.CheckpointInfo:
    state = {"format": 1, "backend": "torch", "step": step, "model": {"w": torch.arange(1000.0)}}
    return ckpt.write_checkpoint(root, identity=identity("torch", **identity_changes), step=step,
                                 weight_version=str(step), state=state, run_state={"step": step})


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    small_checkpoint(tmp_path, 3)
    newest = small_checkpoint(tmp_path, 6)
    shard = newest.shard(0)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    found, skipped = ckpt.newest_complete(tmp_path)
    assert found is not None and found.step == 3
    assert len(skipped) == 1 and "step_00000006" in skipped[0] and "truncated" in skipped[0]


@pytest.mark.parametrize("damage, why", [
    (lambda info: (info.directory / ckpt.MARKER).unlink(), "incomplete"),
    (lambda info: info.shard(0).write_bytes(b"x" * info.shard(0).stat().st_size), "checksum"),
    (lambda info: info.shard(0).unlink(), "missing"),
    (lambda info: (info.directory / ckpt.META).write_text("{"), "unreadable"),
])
def test_every_damage_is_named(tmp_path, damage, why):
    info = small_checkpoint(tmp_path, 6)
    damage(info)
    with pytest.raises(ckpt.CheckpointInvalid, match=why):
        ckpt.validate(info.directory)
    found, skipped = ckpt.newest_complete(tmp_path)
    assert found is None and len(skipped) == 1 and why in skipped[0]


def test_a_checkpoint_of_another_run_model_or_layout_is_refused(tmp_path):
    info = small_checkpoint(tmp_path, 3)
    ckpt.check_identity(info, identity("torch"))
    for changes, named in (({"run": "other"}, "run"), ({"model_path": "tiny://qwen2"}, "model_path"),
                           ({"backend": "megatron"}, "backend"), ({"world_size": 2}, "world_size"),
                           ({"tensor_parallel": 2}, "tensor_parallel")):
        with pytest.raises(ckpt.CheckpointMismatch, match=named):
            ckpt.check_identity(info, identity("torch", **changes))


def test_a_leftover_incomplete_directory_is_replaced_and_pruning_keeps_the_newest(tmp_path):
    small_checkpoint(tmp_path, 3)
    leftover = ckpt.step_dir(tmp_path, 6)
    leftover.mkdir()
    (leftover / "rank_00000.pt").write_bytes(b"half")
    assert ckpt.newest_complete(tmp_path)[0].step == 3
    small_checkpoint(tmp_path, 6)
    small_checkpoint(tmp_path, 9)
    ckpt.step_dir(tmp_path, 12).mkdir()  # a write in progress
    removed = ckpt.prune(tmp_path, keep=2)
    assert [p.name for p in removed] == ["step_00000003"]
    assert [p.name for p in ckpt.step_dirs(tmp_path)] == ["step_00000012", "step_00000009", "step_00000006"]


def test_finalize_waits_for_every_rank(tmp_path):
    """With several ranks the checkpoint is complete only when every rank's shard is."""
    two = identity("megatron", world_size=2, tensor_parallel=2)
    directory = ckpt.step_dir(tmp_path, 3)
    ckpt.write_shard(directory, 0, {"model": {}})
    with pytest.raises(ckpt.CheckpointInvalid, match="rank 1"):
        ckpt.finalize(directory, identity=two, step=3, weight_version="3", run_state={})
    assert ckpt.newest_complete(tmp_path)[0] is None
    ckpt.write_shard(directory, 1, {"model": {}})
    info = ckpt.finalize(directory, identity=two, step=3, weight_version="3", run_state={})
    assert ckpt.validate(directory).meta["shards"] == ["rank_00000.pt", "rank_00001.pt"]
    assert json.loads((directory / ckpt.MARKER).read_text())["step"] == 3 and info.step == 3


def test_a_checkpoint_of_another_layout_is_refused_naming_both_layouts(tmp_path):
    two = identity("megatron", world_size=2, tensor_parallel=2)
    directory = ckpt.step_dir(tmp_path, 3)
    for rank in (0, 1):
        ckpt.write_shard(directory, rank, {"model": {}})
    info = ckpt.finalize(directory, identity=two, step=3, weight_version="3", run_state={})
    ckpt.check_identity(info, two)
    for other, layout in ((identity("megatron"), "tensor 1 x pipeline 1 x data 1 (1 ranks)"),
                          (identity("megatron", world_size=2), "tensor 1 x pipeline 1 x data 2 (2 ranks)"),
                          (identity("megatron", world_size=4, tensor_parallel=2),
                           "tensor 2 x pipeline 1 x data 2 (4 ranks)")):
        with pytest.raises(ckpt.CheckpointMismatch) as refused:
            ckpt.check_identity(info, other)
        message = str(refused.value)
        assert "written by a trainer of tensor 2 x pipeline 1 x data 1 (2 ranks)" in message, message
        assert f"this run's trainer is {layout}" in message and "no resharding" in message, message
    with pytest.raises(ckpt.CheckpointMismatch) as refused:  # not a layout difference: no layout text
        ckpt.check_identity(info, identity("megatron", run="other", world_size=2, tensor_parallel=2))
    assert "run: checkpoint 'r' != this run 'other'" in str(refused.value)
    assert "resharding" not in str(refused.value)


def test_the_checkpoint_is_complete_only_when_every_rank_reported_its_shard():
    written = {"size": 10, "sha256": "ab"}
    ckpt.check_shard_reports(6, [written, written], world=2)
    with pytest.raises(ckpt.CheckpointInvalid, match="1 of 2 ranks reported"):
        ckpt.check_shard_reports(6, [written], world=2)
    with pytest.raises(ckpt.CheckpointInvalid, match=r"rank 1: OSError: \[Errno 28\] No space left"):
        ckpt.check_shard_reports(6, [written, {"error": "OSError: [Errno 28] No space left on device"}], world=2)
    with pytest.raises(ckpt.CheckpointInvalid, match="rank 0: no report"):
        ckpt.check_shard_reports(6, [None, written], world=2)


@pytest.mark.parametrize("layout, writers, sources", [
    ((1, 1, 1), [True], [0]),
    ((2, 1, 1), [True, True], [0, 1]),
    ((1, 1, 2), [True, False], [0, 0]),
    ((2, 1, 2), [True, True, False, False], [0, 1, 0, 1]),  # tensor rank fastest, then the replica
])
def test_only_the_first_data_parallel_replica_writes_weights(layout, writers, sources):
    from rlfleet.trainer.parallel import ParallelLayout

    parallel = ParallelLayout(*layout)
    assert [ckpt.writes_weights(r, parallel) for r in range(parallel.world)] == writers
    assert [ckpt.source_rank(r, parallel) for r in range(parallel.world)] == sources


def test_a_replica_resumes_the_weights_of_its_source_rank_and_its_own_rng(tiny_model, tmp_path):
    """Data parallel 2: rank 1's shard holds its RNG and step only; it restores rank 0's weights."""
    trainer = build_trainer("torch", tiny_model, lr=1e-2)
    trainer.train_step(batches(trainer, 1)[0])
    two = identity("torch", world_size=2)
    directory = ckpt.step_dir(tmp_path, 1)
    ckpt.write_shard(directory, 0, ckpt.capture_state(trainer))
    torch.manual_seed(1234)
    replica = ckpt.capture_state(trainer, weights=False)
    after_replica_capture = torch.rand(3)
    assert "model" not in replica and "optimizer" not in replica
    ckpt.write_shard(directory, 1, replica)
    info = ckpt.finalize(directory, identity=two, step=1, weight_version="1", run_state={})
    assert ckpt.validate(directory).meta["shards"] == ["rank_00000.pt", "rank_00001.pt"]

    fresh = build_trainer("torch", tiny_model, lr=1e-2)
    with pytest.raises(ckpt.CheckpointMismatch, match="holds no weights"):
        ckpt.restore_state(fresh, ckpt.load_shard(info, 1))
    ckpt.restore_rank(fresh, info, 1)
    assert fresh.step == 1 and torch.equal(torch.rand(3), after_replica_capture)
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(fresh.hf_state_dict()[name], trainer.hf_state_dict()[name])
    assert fresh.optimizer.state_dict()["state"].keys() == trainer.optimizer.state_dict()["state"].keys()


def test_a_leftover_directory_is_removed_before_ranks_write_into_it(tmp_path):
    leftover = ckpt.step_dir(tmp_path, 6)
    leftover.mkdir()
    (leftover / "rank_00001.done").write_text("{}")  # of a killed run: must not count for this one
    assert ckpt.prepare_step_dir(tmp_path, 6) == leftover and not leftover.exists()
    broken = small_checkpoint(tmp_path, 9)  # a resume skipped it (corrupt): rewritten from scratch
    broken.shard(0).write_bytes(b"x")
    assert ckpt.prepare_step_dir(tmp_path, 9) == broken.directory and not broken.directory.exists()
    assert ckpt.prepare_step_dir(tmp_path, 12) == ckpt.step_dir(tmp_path, 12)  # nothing there: nothing to do


def test_a_shard_of_another_optimizer_format_is_refused_naming_both(tiny_model):
    """A CPU megatron trainer's shard holds AdamW's state dict; one written on GPUs holds megatron's distributed
    optimizer state ("megatron-distributed", with its gathered shards). Neither resumes into the other."""
    trainer = build_trainer("megatron", tiny_model, lr=1e-2)
    trainer.train_step(batches(trainer, 1)[0])
    state = ckpt.capture_state(trainer)
    assert state["optimizer_format"] == "torch" and "optimizer_shards" not in state
    written_on_gpus = {**state, "optimizer_format": "megatron-distributed", "optimizer_shards": [{}]}
    fresh = build_trainer("megatron", tiny_model, lr=1e-2)
    with pytest.raises(ckpt.CheckpointMismatch, match="'megatron-distributed', this trainer's is 'torch'"):
        ckpt.restore_state(fresh, written_on_gpus)
    assert fresh.step == 0
    ckpt.restore_state(fresh, state)
    assert fresh.step == 1


def test_step_counts_set_aside_for_megatron_shards_and_given_back_unshared():
    """Megatron's shard load copies every key of torch AdamW's state from shards that hold no `step`;
    the counts are set aside meanwhile and come back one tensor per parameter, so the next step
    advances each by one (a shared count would advance once per parameter)."""
    from rlfleet.trainer.megatron_backend import step_counts_set_aside

    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(3)]
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    for p in params:
        p.grad = torch.ones(3)
    optimizer.step()
    shared = torch.tensor(5.0)  # as megatron's load_state_dict leaves them
    for p in params:
        optimizer.state[p]["step"] = shared

    with step_counts_set_aside(optimizer.state):
        assert all(set(optimizer.state[p]) == {"exp_avg", "exp_avg_sq"} for p in params)
    optimizer.step()

    assert [float(optimizer.state[p]["step"]) for p in params] == [6.0, 6.0, 6.0]
