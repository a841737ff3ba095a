"""The checksums the trainer predicts for an engine running SGLang's own model code (a CUDA engine) equal
what SGLang's `/weights_checker` computes, on one rank, on two tensor-parallel ranks and on two pipeline
stages.

SGLang's real model classes and weight loaders build each model in real gloo groups of those ranks and
load its safetensors; SGLang's own `WeightChecker` hashes what each rank holds (see
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
LAYOUTS = ((1, 1), (2, 1), (1, 2))  # (tensor parallel, pipeline parallel)


def write_models(root: Path) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    from rlfleet.trainer.tiny import build_config, ensure_tiny_model
    from rlfleet.util.binaries import CACHE_DIR

    cache = CACHE_DIR / "models"
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


def sglang_checksums(models: Mapping[str, Path], tp: int, pp: int, out: Path) -> dict[str, list[RankChecksums]]:
    """Every rank's /weights_checker answer for every model, from SGLang's own code in tp x pp processes."""
    port, world = str(free_port()), tp * pp
    procs = [subprocess.Popen([sys.executable, str(HELPER), str(rank), str(tp), str(pp), port, str(out),
                               *map(str, models.values())], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank in range(world)]
    logs = [p.communicate(timeout=600)[0].decode(errors="replace") for p in procs]
    for rank, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} of {world}: exit {proc.returncode}\n{log[-3000:]}"
    answers = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(world)]
    return {name: [RankChecksums.from_reply(a[str(path)], world) for a in answers] for name, path in models.items()}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("served-weights")
    models = write_models(root)
    return {"models": models,
            "layouts": {(tp, pp): sglang_checksums(models, tp, pp, root / f"tp{tp}-pp{pp}.json") for tp, pp in LAYOUTS}}


def trainer_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def predicted(tensors: Mapping[str, torch.Tensor], model_dir: Path, ranks: int) -> list[dict[str, str]]:
    layout = EngineLayout.of(device="cuda", tp_size=ranks, config=shape_config(model_dir))
    assert isinstance(layout, EngineLayout), layout
    return [plan.checksums(tensors, layout=layout, rank=rank) for rank in range(ranks)]


@pytest.mark.parametrize(("tp", "pp"), LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_every_served_tensor_of_every_rank_equals_the_trainers_prediction(served: dict[str, Any], model: str,
                                                                         tp: int, pp: int):
    model_dir = served["models"][model]
    answer = served["layouts"][(tp, pp)][model]
    assert sorted(r.tp_rank or 0 for r in answer) == sorted(list(range(tp)) * pp)
    assert {(r.tp_size, r.pp_size) for r in answer} == {(tp, pp)}
    expected = predicted(trainer_tensors(model_dir), model_dir, tp)
    for rank in answer:  # every name SGLang hashes is predicted, with the same checksum
        assert rank.checksums == {name: expected[rank.tp_rank or 0].get(name) for name in rank.checksums}
    for tp_rank in range(tp):  # and every predicted name is hashed by a rank (a stage of it, with pp), but
        # a tied lm_head, which only the last stage of some model classes keeps (qwen3's, here)
        hashed = set().union(*(r.checksums for r in answer if r.tp_rank == tp_rank))
        assert set(expected[tp_rank]) - hashed <= {"lm_head.weight"}
        assert ("lm_head.weight" in hashed) == (model != "llama" and (pp > 1 or model == "qwen2-one-kv-head"))
    verdict = plan.compare_engine(expected, answer)
    assert isinstance(verdict, plan.ChecksumVerdict) and verdict.ok
    assert verdict.compared == sum(len(r.checksums) for r in answer)
    # The Hugging Face tensors as they are (a CPU engine's layout) leave SGLang's fused q/k/v and gate/up
    # (and the padded vocabulary) out: what the verification compared before it knew the layout.
    if (tp, pp) == (1, 1):
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
    verdict = plan.compare_engine(predicted(tensors, model_dir, ranks), served["layouts"][(ranks, 1)][model])
    assert isinstance(verdict, plan.ChecksumVerdict) and not verdict.ok
    where = [f" (tp rank {r})" for r in holders] if ranks > 1 else [""]
    assert list(verdict.mismatched) == [f"model.layers.1.self_attn.qkv_proj.weight{w}" for w in where]
