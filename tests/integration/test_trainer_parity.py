"""Both trainer backends export Hugging Face snapshots that compute what the trainer computes.

For `torch` and `megatron` (megatron-core GPTModel on CPU), and for each model family the trainer
supports that differs in layout (the tiny Llama; the tiny Qwen3 with per-head q/k norms and a head_dim
other than hidden / heads), after a few real GRPO steps:
- the exported snapshot loaded by transformers gives the trainer's own logits (max abs diff
  below LOGITS_TOLERANCE, float32);
- one real SGLang engine (float32), loading each snapshot with /update_weights_from_disk, reports
  the snapshot's weight version and produces the trainer's greedy tokens, with logprobs within
  LOGPROB_TOLERANCE of the trainer's.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
import torch

from rlfleet.sglang.engine import EngineClient
from rlfleet.snapshot.format import MANIFEST_NAME, MARKER_NAME, validate_snapshot
from rlfleet.trainer import grpo
from rlfleet.trainer.base import Trainer, build_trainer
from rlfleet.trainer.tasks import ProblemStream, TaskSpec

BACKENDS = ("torch", "megatron")
TRAIN_STEPS = 4
LOGITS_TOLERANCE = 1e-4  # float32, same weights, different kernels
LOGPROB_TOLERANCE = 1e-3  # SGLang's float32 CPU path vs the trainer, per generated token
GREEDY_TOKENS = 6
PROMPTS = ["abc=", "dcba=", "bad=", "ccc=", "a=", "dab=", "cb=", "abcdabcd="]


def encode(text: str) -> list[int]:
    # The tiny tokenizer is byte-level with no added specials: a byte is a token.
    return list(text.encode())


def on_policy_logprobs(trainer: Trainer, prompt: list[int], response: list[int]) -> tuple[float, ...]:
    ids = torch.tensor([prompt + response])
    lp = grpo.token_logprobs(trainer.logits(ids), ids)[0]
    return tuple(lp[len(prompt) - 1:].tolist())


def training_groups(trainer: Trainer, step: int) -> list[list[grpo.Sample]]:
    """Per prompt, the right answer (reward 1) and a wrong one (reward 0), scored on-policy."""
    groups = []
    for i, problem in enumerate(ProblemStream(TaskSpec("rotate"), seed=step).take(8)):
        prompt = encode(problem.prompt)
        group = []
        for reward, text in ((1.0, problem.answer), (0.0, problem.answer[::-1] + "x")):
            response = encode(text)
            group.append(grpo.Sample(tuple(prompt), tuple(response), on_policy_logprobs(trainer, prompt, response),
                                     weight_version=str(trainer.step), reward=reward, group_id=f"{step}-{i}"))
        groups.append(group)
    return groups


def train_both(model_dir: Path) -> dict[str, Trainer]:
    trainers = {}
    for backend in BACKENDS:
        trainer = build_trainer(backend, model_dir, lr=1e-2, seed=0)
        policy = grpo.StalenessPolicy(0)
        for step in range(TRAIN_STEPS):
            batch = grpo.assemble_batch(training_groups(trainer, step), current_step=trainer.step, policy=policy)
            metrics = trainer.train_step(batch.samples)
            assert metrics["tokens"] > 0 and metrics["grad_norm"] > 0
        assert trainer.step == TRAIN_STEPS
        trainers[backend] = trainer
    return trainers


@pytest.fixture(scope="module")
def trained(tiny_model: Path) -> dict[str, Trainer]:
    return train_both(tiny_model)


@pytest.fixture(scope="module")
def snapshots(trained: dict[str, Trainer], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return export_all(trained, tmp_path_factory.mktemp("snapshots"))


def export_all(trained: dict[str, Trainer], root: Path) -> dict[str, Path]:
    return {b: t.export_hf(root / b / f"step_{t.step}", t.step) for b, t in trained.items()}


@pytest.fixture(scope="module")
def tiny_qwen3() -> Path:
    from rlfleet.trainer.tiny import ensure_tiny_model
    from rlfleet.util.binaries import CACHE_DIR

    return ensure_tiny_model(CACHE_DIR / "models" / "tiny-qwen3-seed0", seed=0, arch="qwen3")


@pytest.fixture(scope="module")
def trained_qwen3(tiny_qwen3: Path) -> dict[str, Trainer]:
    return train_both(tiny_qwen3)


@pytest.fixture(scope="module")
def snapshots_qwen3(trained_qwen3: dict[str, Trainer], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return export_all(trained_qwen3, tmp_path_factory.mktemp("snapshots-qwen3"))


def probe_tokens() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (4, 24), generator=generator)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_exported_snapshot_gives_the_trainers_logits(backend, family, request):
    from transformers import AutoModelForCausalLM

    suffix = "" if family == "llama" else "_qwen3"
    trained, snapshots = request.getfixturevalue("trained" + suffix), request.getfixturevalue("snapshots" + suffix)
    tiny_model = request.getfixturevalue("tiny_model" if family == "llama" else "tiny_qwen3")
    trainer, snapshot = trained[backend], snapshots[backend]
    assert (snapshot / MARKER_NAME).is_file() and (snapshot / MANIFEST_NAME).is_file()
    assert {p.name for p in snapshot.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                    "tokenizer_config.json", "generation_config.json"}
    assert all(p.stat().st_mode & 0o044 == 0o044 for p in snapshot.iterdir())
    validate_snapshot(snapshot)
    model = AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = probe_tokens()
    with torch.no_grad():
        exported, before = model(ids).logits, initial(ids).logits
    ours = trainer.logits(ids)
    diff = (exported - ours).abs().max().item()
    print(f"{family} {backend}: max |exported - trainer| logits = {diff:.2e}")
    assert diff < LOGITS_TOLERANCE
    # The steps really changed the weights (so the comparison is not of two untouched copies).
    assert (before - ours).abs().max().item() > 100 * LOGITS_TOLERANCE


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_megatron_trains_like_torch(family, request):
    trained = request.getfixturevalue("trained" if family == "llama" else "trained_qwen3")
    ids = probe_tokens()
    diff = (trained["torch"].logits(ids) - trained["megatron"].logits(ids)).abs().max().item()
    print(f"{family}: max |torch - megatron| logits after {TRAIN_STEPS} steps = {diff:.2e}")
    assert diff < 1e-3


@pytest.fixture(scope="module")
def float32_engine(lent_shared_engine):
    # float32 so greedy choices and logprobs are the trainer's (SGLang's default casts float32 to float16;
    # the launch builder gives CPU engines float32): the session's shared engine of the tiny model.
    return lent_shared_engine


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def float32_qwen3_engine(session_sglang_engines, tiny_qwen3):
    engine = await session_sglang_engines.start(tiny_qwen3, name="parity-qwen3-engine",
                                                extra_args=("--dtype", "float32"))
    try:
        yield engine
    finally:
        await engine.stop()


@pytest.mark.engines
async def test_sglang_serving_each_snapshot_matches_the_trainer(float32_engine, trained, snapshots):
    await serving_matches_trainer(float32_engine.url, trained, snapshots, "llama")


@pytest.mark.engines
async def test_sglang_serving_qwen3_snapshots_matches_the_trainer(float32_qwen3_engine, trained_qwen3,
                                                                  snapshots_qwen3):
    await serving_matches_trainer(float32_qwen3_engine.url, trained_qwen3, snapshots_qwen3, "qwen3")


async def serving_matches_trainer(url: str, trained: dict[str, Trainer], snapshots: dict[str, Path],
                                  family: str) -> None:
    async def greedy(client: EngineClient, prompt: list[int]) -> grpo.Sample:
        body = await client.generate({
            "input_ids": prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": GREEDY_TOKENS, "ignore_eos": True},
            "return_logprob": True,
        })
        return grpo.sample_from_generate(prompt, body)

    async with aiohttp.ClientSession() as session:
        client = EngineClient(session, url)
        untrained = {text: (await greedy(client, encode(text))).response_ids for text in PROMPTS}
        for backend in BACKENDS:
            trainer, snapshot = trained[backend], snapshots[backend]
            version = f"{trainer.step}"
            result = await client.update_weights_from_disk(str(snapshot), version)
            assert result.success, result.message
            assert await client.weight_version() == version
            worst = 0.0
            changed = 0
            for text in PROMPTS:
                prompt = encode(text)
                sample = await greedy(client, prompt)
                assert sample.weight_version == version
                changed += sample.response_ids != untrained[text]
                expected = await asyncio.to_thread(trainer.greedy_generate, prompt, GREEDY_TOKENS)
                assert list(sample.response_ids) == expected, f"{family} {backend}: greedy tokens differ for {text!r}"
                ours = on_policy_logprobs(trainer, prompt, expected)
                assert len(sample.sampling_logprobs) == len(ours) == GREEDY_TOKENS
                worst = max(worst, max(abs(a - b) for a, b in zip(ours, sample.sampling_logprobs, strict=True)))
            print(f"{family} {backend}: SGLang float32 greedy tokens match; max |logprob diff| = {worst:.2e}; "
                  f"{changed}/{len(PROMPTS)} answers differ from the untrained model's")
            assert worst < LOGPROB_TOLERANCE
            assert changed > 0, "the snapshot answers like the untrained model: were the weights loaded?"
