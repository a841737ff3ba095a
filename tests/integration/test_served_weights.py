"""The checksums the trainer predicts for an engine running SGLang's own model code (a CUDA engine) equal
what SGLang's `/weights_checker` computes, on one tensor-parallel rank and on two.

SGLang's real model classes and weight loaders build each model in a real gloo group of one and of two
ranks and load its safetensors; SGLang's own `WeightChecker` hashes what each rank holds (see
tests/helpers/sglang_native_ranks.py for what differs from a GPU engine: nothing in the weights). The
models: the tiny Llama and Qwen3, and a Qwen2 with q/k/v biases, one kv head (so two ranks both hold
it), an untied lm_head and a vocabulary of 300 (SGLang pads it to 320 with zero rows).
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rlfleet.orchestrator.fleet import broadcast_plan as plan
from rlfleet.orchestrator.fleet.served_weights import EngineLayout
from rlfleet.sglang.engine import RankChecksums
from rlfleet.snapshot.format import shape_config

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "sglang_native_ranks.py"
MODELS = ("llama", "qwen3", "qwen2-one-kv-head")
RANKS = (1, 2)


def write_models(root: Path) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    from rlfleet.trainer.tiny import build_config, ensure_tiny_model

    cache = Path.home() / ".cache" / "rlfleet" / "models"
    models = {"llama": ensure_tiny_model(cache / "tiny-llama-seed0", seed=0, arch="llama"),
              "qwen3": ensure_tiny_model(cache / "tiny-qwen3-seed0", seed=0, arch="qwen3")}
    config = build_config("qwen2")
    config.update({"num_key_value_heads": 1, "vocab_size": 300, "tie_word_embeddings": False})
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    models["qwen2-one-kv-head"] = root / "qwen2-one-kv-head"
    model.save_pretrained(models["qwen2-one-kv-head"], safe_serialization=True)
    return models


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sglang_checksums(models: Mapping[str, Path], ranks: int, out: Path) -> dict[str, list[RankChecksums]]:
    """Every rank's /weights_checker answer for every model, from SGLang's own code in `ranks` processes."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(HELPER), str(rank), str(ranks), port, str(out),
                               *map(str, models.values())], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank in range(ranks)]
    logs = [p.communicate(timeout=600)[0].decode(errors="replace") for p in procs]
    for rank, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} of {ranks}: exit {proc.returncode}\n{log[-3000:]}"
    answers = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(ranks)]
    return {name: [RankChecksums.from_reply(a[str(path)], ranks) for a in answers] for name, path in models.items()}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("served-weights")
    models = write_models(root)
    return {"models": models,
            "ranks": {ranks: sglang_checksums(models, ranks, root / f"tp{ranks}.json") for ranks in RANKS}}


def trainer_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def predicted(tensors: Mapping[str, torch.Tensor], model_dir: Path, ranks: int) -> list[dict[str, str]]:
    layout = EngineLayout.of(device="cuda", tp_size=ranks, config=shape_config(model_dir))
    assert isinstance(layout, EngineLayout), layout
    return [plan.checksums(tensors, layout=layout, rank=rank) for rank in range(ranks)]


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("model", MODELS)
def test_every_served_tensor_of_every_rank_equals_the_trainers_prediction(served: dict[str, Any], model: str,
                                                                         ranks: int):
    model_dir = served["models"][model]
    answer = served["ranks"][ranks][model]
    assert sorted(r.tp_rank for r in answer) == list(range(ranks)) and {r.tp_size for r in answer} == {ranks}
    expected = predicted(trainer_tensors(model_dir), model_dir, ranks)
    for rank in answer:  # every name SGLang hashes, and nothing else, with the same checksum
        assert expected[rank.tp_rank or 0] == rank.checksums, f"tp rank {rank.tp_rank}"
    verdict = plan.compare_engine(expected, answer)
    assert isinstance(verdict, plan.ChecksumVerdict) and verdict.ok
    assert verdict.compared == sum(len(r.checksums) for r in answer) and not verdict.unmatched
    # The Hugging Face tensors as they are (a CPU engine's layout) leave SGLang's fused q/k/v and gate/up
    # (and the padded vocabulary) out: what the verification compared before it knew the layout.
    if ranks == 1:
        as_exported = plan.compare_checksums(plan.checksums(trainer_tensors(model_dir)), answer[0].checksums)
        assert as_exported.compared < verdict.compared and as_exported.unmatched


@pytest.mark.parametrize(("model", "ranks", "holders"), [
    ("llama", 1, [0]),
    ("llama", 2, [1]),  # layer 1's kv heads: one per rank; the last row is the second head's
    ("qwen2-one-kv-head", 2, [0, 1]),  # the one kv head is held by both ranks
])
def test_a_tensor_the_engine_did_not_get_is_a_mismatch_on_the_ranks_that_hold_it(served: dict[str, Any],
                                                                                model: str, ranks: int,
                                                                                holders: list[int]):
    model_dir = served["models"][model]
    tensors = trainer_tensors(model_dir)
    tensors["model.layers.1.self_attn.k_proj.weight"][-1, 0] += 1.0  # the trainer sent other bytes than these
    verdict = plan.compare_engine(predicted(tensors, model_dir, ranks), served["ranks"][ranks][model])
    assert isinstance(verdict, plan.ChecksumVerdict) and not verdict.ok
    where = [f" (tp rank {r})" for r in holders] if ranks > 1 else [""]
    assert list(verdict.mismatched) == [f"model.layers.1.self_attn.qkv_proj.weight{w}" for w in where]
