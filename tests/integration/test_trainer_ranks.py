"""Multi-rank trainers on CPU (gloo, real megatron-core, real torch.distributed ranks from the elastic launcher)
train like one rank.

The same four GRPO steps (the tiny Llama; batches scored by the initial weights, so later steps are
off-policy and the loss depends on the weights) through megatron TP=2, PP=2, DP=2, TP=2 x DP=2 and
TP=2 x PP=2, and torch DP=2 as DDP replicas and as FSDP (sharded) replicas, against one rank of the same
backend: the loss and gradient norm of every step and every exported HF weight agree within 1e-4
(float32), and each export is one snapshot in the single-rank layout (same files, tensor names, shapes
and dtypes). SGLang loading that layout is proven in test_trainer_parity.py (the single-rank export);
here an engine loads the TP=2 x DP=2 export and its greedy tokens equal the single-rank trainer's. Qwen3
(per-head q/k norms) trains alike under TP=2. FSDP replicas with unequal micro-batch counts train like one
rank, and an FSDP checkpoint (whole tensors) resumes in its ranks and in one rank. A rank that dies stops
the group and is named with its last log lines; rank 0 failing inside a step, the other rank waiting for
it in the step's reduction, stops the group within seconds, named with its own error.

World 2 runs its five layouts one after another in the same ranks (one launch); world 4 its two likewise.
"""
from __future__ import annotations

import asyncio
import pickle
import time
from pathlib import Path

import aiohttp
import pytest
from safetensors.torch import load_file

from helpers.rank_steps import (
    checkpoint_round_trip,
    fail_in_step,
    relay_commands,
    train_layouts,
    train_steps,
    trainer_label,
)
from rlfleet.sglang.engine import EngineClient
from rlfleet.snapshot.format import validate_snapshot
from rlfleet.trainer import grpo
from rlfleet.trainer.launch import RankFailed, launch_ranks
from rlfleet.trainer.ranks import _Commands

STEPS = 4
TOLERANCE = 1e-4
WORLD_2 = [("megatron", (2, 1, 1)), ("megatron", (1, 2, 1)), ("megatron", (1, 1, 2)), ("torch", (1, 1, 2)),
           ("torch-fsdp", (1, 1, 2))]
WORLD_4 = [("megatron", (2, 1, 2)), ("megatron", (2, 2, 1))]
LAYOUTS = WORLD_2 + WORLD_4


def layout_id(run: tuple[str, tuple[int, int, int]]) -> str:
    backend, (tp, pp, dp) = run
    return f"{backend}-tp{tp}-pp{pp}-dp{dp}"


def backend_of(run: tuple[str, tuple[int, int, int]]) -> str:
    """The backend of a run's label ("torch-fsdp": torch, its replicas sharded)."""
    return trainer_label(run[0])[0]


@pytest.fixture(scope="module")
def single_rank(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("one-rank")
    return {b: train_steps(b, str(tiny_model), (1, 1, 1), STEPS, str(out / b)) for b in ("megatron", "torch")}


@pytest.fixture(scope="module")
def many_ranks(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("ranks")
    results: dict[str, dict] = {}
    for world, runs in ((2, WORLD_2), (4, WORLD_4)):
        by_rank = launch_ranks(train_layouts, (runs, str(tiny_model), STEPS, str(out / f"world{world}")),
                               world=world, log_dir=out / f"logs{world}")
        assert all(by_rank[r] == [None] * len(runs) for r in range(1, world)), "only rank 0 reports"
        for run, result in zip(runs, by_rank[0], strict=True):
            print(f"{layout_id(run)}: {STEPS} steps in {result['seconds']:.1f} s (rank 0, with set-up)")
            results[layout_id(run)] = result
    return results


@pytest.mark.parametrize("run", LAYOUTS, ids=layout_id)
def test_every_step_matches_one_rank(run, single_rank, many_ranks):
    ours, reference = many_ranks[layout_id(run)], single_rank[backend_of(run)]
    loss_diff = max(abs(a - b) for a, b in zip(ours["losses"], reference["losses"], strict=True))
    norm_diff = max(abs(a - b) for a, b in zip(ours["grad_norms"], reference["grad_norms"], strict=True))
    print(f"{layout_id(run)}: max |loss - one rank's| {loss_diff:.2e}, max |grad norm diff| {norm_diff:.2e}")
    assert len(set(round(x, 4) for x in reference["losses"])) > 1, "the loss does not depend on the weights"
    assert loss_diff < TOLERANCE and norm_diff < TOLERANCE
    # Every statistic of the step line (token count, clip fraction, ratio maximum, ...) is the whole
    # batch's, as one rank reports it: the replicas' parts are summed or maximised in one collective.
    for step, (mine, theirs) in enumerate(zip(ours["stats"], reference["stats"], strict=True), start=1):
        assert set(mine) == set(theirs), f"step {step}: statistics {sorted(set(mine) ^ set(theirs))}"
        worst = {k: abs(mine[k] - theirs[k]) for k in mine if abs(mine[k] - theirs[k]) >= TOLERANCE}
        assert not worst, f"step {step}: statistics differ from one rank's: {worst}"


@pytest.mark.parametrize("run", LAYOUTS, ids=layout_id)
def test_export_is_one_snapshot_with_the_weights_of_one_rank(run, single_rank, many_ranks, tiny_model):
    ours, reference = Path(many_ranks[layout_id(run)]["snapshot"]), Path(single_rank[backend_of(run)]["snapshot"])
    validate_snapshot(ours)
    assert {p.name for p in ours.iterdir()} == {p.name for p in reference.iterdir()}
    mine, theirs = load_file(str(ours / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    initial = load_file(str(tiny_model / "model.safetensors"))
    assert {k: (v.shape, v.dtype) for k, v in mine.items()} == {k: (v.shape, v.dtype) for k, v in theirs.items()}
    worst = max((mine[k] - theirs[k]).abs().max().item() for k in mine)
    moved = max((theirs[k] - initial[k]).abs().max().item() for k in theirs)
    print(f"{layout_id(run)}: max |weight - one rank's| {worst:.2e} (the steps moved weights by up to {moved:.2e})")
    assert worst < TOLERANCE
    assert moved > 100 * TOLERANCE


def test_qwen3_query_and_key_norms_train_like_one_rank_under_tensor_parallelism(tmp_path):
    """Qwen3's q/k norms are whole on every tensor-parallel rank, but each rank's gradient for them comes
    from its own heads only: summed over the group, TP=2 trains and exports like one rank."""
    from rlfleet.trainer.tiny import ensure_tiny_model
    from rlfleet.util.binaries import CACHE_DIR

    model = str(ensure_tiny_model(CACHE_DIR / "models" / "tiny-qwen3-seed0", seed=0, arch="qwen3"))
    reference = train_steps("megatron", model, (1, 1, 1), STEPS, str(tmp_path / "one"))
    ours = launch_ranks(train_steps, ("megatron", model, (2, 1, 1), STEPS, str(tmp_path / "tp2")), world=2,
                        log_dir=tmp_path / "logs")[0]
    assert reference is not None and ours is not None
    loss_diff = max(abs(a - b) for a, b in zip(ours["losses"], reference["losses"], strict=True))
    norm_diff = max(abs(a - b) for a, b in zip(ours["grad_norms"], reference["grad_norms"], strict=True))
    mine, theirs = (load_file(str(Path(r["snapshot"]) / "model.safetensors")) for r in (ours, reference))
    initial = load_file(str(Path(model) / "model.safetensors"))
    norms = [k for k in theirs if k.endswith(("q_norm.weight", "k_norm.weight"))]
    worst = max((mine[k] - theirs[k]).abs().max().item() for k in theirs)
    worst_norm = max((mine[k] - theirs[k]).abs().max().item() for k in norms)
    moved = max((theirs[k] - initial[k]).abs().max().item() for k in norms)
    print(f"qwen3 tp2: loss {loss_diff:.2e}, grad norm {norm_diff:.2e}, q/k norms {worst_norm:.2e} (they moved "
          f"{moved:.2e}), any weight {worst:.2e}")
    assert len(norms) == 4 and moved > 100 * TOLERANCE
    assert loss_diff < TOLERANCE and norm_diff < TOLERANCE and worst_norm < TOLERANCE
    # Adam (lr 1e-2) turns float32 rounding in near-zero gradients into steps of up to ~lr: measured
    # 1.5e-4 here. Unsummed q/k norm gradients put them 5e-2 apart.
    assert worst < 10 * TOLERANCE


def test_fsdp_replicas_with_unequal_micro_batches_train_like_one_rank(tiny_model, tmp_path):
    """Under FSDP every forward and backward pass gathers weights from both replicas, so they must run
    the same passes: 15 samples a step split 8 / 7, 7 per micro-batch, are 2 passes on one replica and 1
    on the other, which adds a pass that contributes nothing. Without it the step hangs. With a KL
    penalty, whose frozen reference model is sharded too (its forward passes gather as well)."""
    reference = train_steps("torch", str(tiny_model), (1, 1, 1), STEPS, str(tmp_path / "one"), samples=15,
                            micro_batch=7, kl_coef=0.5)
    ours = launch_ranks(train_steps, ("torch-fsdp", str(tiny_model), (1, 1, 2), STEPS, str(tmp_path / "fsdp"), None,
                                      7, 15, 0.5), world=2, log_dir=tmp_path / "logs")[0]
    assert reference is not None and ours is not None
    loss_diff = max(abs(a - b) for a, b in zip(ours["losses"], reference["losses"], strict=True))
    norm_diff = max(abs(a - b) for a, b in zip(ours["grad_norms"], reference["grad_norms"], strict=True))
    mine, theirs = (load_file(str(Path(r["snapshot"]) / "model.safetensors")) for r in (ours, reference))
    worst = max((mine[k] - theirs[k]).abs().max().item() for k in theirs)
    print(f"fsdp dp2, micro-batches 2 and 1: loss {loss_diff:.2e}, grad norm {norm_diff:.2e}, weights {worst:.2e}")
    assert [s["samples"] for s in ours["stats"]] == [15.0] * STEPS
    assert max(s["kl_ref"] for s in reference["stats"]) > 100 * TOLERANCE, "the KL penalty never came into play"
    assert loss_diff < TOLERANCE and norm_diff < TOLERANCE and worst < TOLERANCE


def test_an_fsdp_checkpoint_holds_whole_tensors_and_resumes_in_its_ranks_and_in_one_rank(tiny_model, tmp_path):
    """Each FSDP replica holds half the weights and half the AdamW moments; the checkpoint gathers them
    whole. Restored into the same two ranks, the steps after it repeat; restored into one rank (torch's
    own optimizer state, as a single rank writes it), the same steps give the same losses."""
    from rlfleet.trainer import checkpoint as ckpt
    from rlfleet.trainer.base import build_trainer

    ours = launch_ranks(checkpoint_round_trip, ("torch-fsdp", str(tiny_model), (1, 1, 2), str(tmp_path / "ckpt")),
                        world=2, log_dir=tmp_path / "logs")[0]
    assert ours is not None
    assert ours["weights_held"] == pytest.approx(0.5, abs=0.02) and ours["moments_held"] == pytest.approx(0.5, abs=0.02)
    assert ours["again"] == ours["after"], "the steps after the restore differ from those after the checkpoint"
    info = ckpt.validate(ours["checkpoint"])
    shard = ckpt.load_shard(info, 0)
    initial = load_file(str(tiny_model / "model.safetensors"))
    assert set(initial) <= set(shard["model"])
    assert all(shard["model"][k].shape == v.shape for k, v in initial.items())
    assert set(shard["optimizer"]["state"]) == set(range(len(shard["optimizer"]["param_groups"][0]["params"])))
    one = build_trainer("torch", tiny_model, lr=1e-2, seed=0)
    ckpt.restore_state(one, shard)
    losses = [one.train_step(batch)["loss"] for batch in ours["batches"]]
    print(f"fsdp checkpoint in one rank: losses {losses}, in its two ranks {ours['after']}")
    assert max(abs(a - b) for a, b in zip(losses, ours["after"], strict=True)) < TOLERANCE


def blob_command(pickled_size: int) -> tuple:
    """A ("blob", bytes) command whose pickle is exactly `pickled_size` bytes."""
    for length in range(pickled_size, pickled_size - 64, -1):
        command = ("blob", bytes(range(256)) * (length // 256) + bytes(length % 256))
        if len(pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)) == pickled_size:
            return command
    raise AssertionError(f"no blob pickles to {pickled_size} bytes")


def test_commands_of_any_size_reach_every_rank_intact(tmp_path):
    """Small commands, a pickle that fills the frame exactly, one a byte over it, one many frames long."""
    room = _Commands.FRAME - _Commands._LENGTH
    commands = [("stop",), ("logits", list(range(100))), blob_command(room), blob_command(room + 1),
                blob_command(5 * room + 17), ("state",)]
    by_rank = launch_ranks(relay_commands, (commands,), world=3, log_dir=tmp_path)
    assert by_rank[0] is None
    assert by_rank[1] == commands and by_rank[2] == commands


def test_a_dying_rank_stops_the_group_and_is_named(tiny_model, tmp_path):
    with pytest.raises(RankFailed) as failed:
        launch_ranks(train_steps, ("megatron", str(tiny_model), (2, 1, 1), STEPS, str(tmp_path / "out"), 1),
                     world=2, log_dir=tmp_path / "logs")
    assert failed.value.rank == 1 and failed.value.exitcode == 3
    assert "rank 1: failing on purpose" in failed.value.log_tail
    assert "trainer rank 1 exited with 3" in str(failed.value) and failed.value.reason == "TrainerRankFailed"


def running(pid: int) -> bool:
    """True while process `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_rank_0_failing_inside_a_step_stops_the_group_at_once_and_is_named(tiny_model, tmp_path):
    """Rank 0's part of a step raises while rank 1 waits for it in the step's gradient reduction (which
    only the 30-minute collective timeout would end): the group stops within seconds, the failure is
    rank 0's with its own error, and no rank is left."""
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(RankFailed) as failed:
        launch_ranks(fail_in_step, (str(tiny_model), str(out)), world=2, log_dir=tmp_path / "logs")
    took = time.time() - float((out / "step-began").read_text())
    print(f"rank 0 failed inside its step: the group stopped {took:.1f} s after the step began")
    assert took < 60, f"the group took {took:.0f} s to stop"
    assert failed.value.rank == 0 and failed.value.exitcode == 1, str(failed.value)
    assert "IndexError: index out of range" in failed.value.log_tail, failed.value.log_tail
    left = [p.name for p in out.glob("pid-*") if running(int(p.read_text()))]
    assert not left, f"ranks still running: {left}"


@pytest.fixture(scope="module")
def float32_engine(lent_shared_engine):
    return lent_shared_engine  # the tiny model in float32 (CPU engines' default), lent by the session


@pytest.mark.engines
async def test_sglang_serves_the_gathered_export_like_one_rank(float32_engine, many_ranks, single_rank):
    from rlfleet.trainer.base import build_trainer

    snapshot = Path(many_ranks[layout_id(WORLD_4[0])]["snapshot"])
    one_rank = await asyncio.to_thread(build_trainer, "torch", Path(single_rank["megatron"]["snapshot"]), lr=1e-3)
    async with aiohttp.ClientSession() as session:
        client = EngineClient(session, float32_engine.url)
        result = await client.update_weights_from_disk(str(snapshot), str(STEPS))
        assert result.success, result.message
        for text in ("abc=", "dcba=", "bad=", "cb="):
            prompt = list(text.encode())
            body = await client.generate({"input_ids": prompt, "return_logprob": True, "sampling_params": {
                "temperature": 0, "max_new_tokens": 6, "ignore_eos": True}})
            sample = grpo.sample_from_generate(prompt, body)
            assert sample.weight_version == str(STEPS)
            expected = await asyncio.to_thread(one_rank.greedy_generate, prompt, 6)
            assert list(sample.response_ids) == expected, f"greedy tokens differ for {text!r}"
