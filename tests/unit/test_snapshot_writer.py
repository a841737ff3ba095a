"""Writing HF snapshots from CPU tensors: sharding, config dtype, tokenizer files, sealing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlfleet.snapshot.format import MANIFEST_NAME, MARKER_NAME, validate_snapshot
from rlfleet.snapshot.writer import (
    WEIGHTS_INDEX_NAME,
    ExportState,
    config_with_dtype,
    shard_plan,
    write_hf_snapshot,
)
from rlfleet.trainer.base import TrainerOptions, build_trainer

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4, "vocab_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "intermediate_size": 8}


def state(tmp_path: Path, step: int = 3) -> ExportState:
    source = tmp_path / "source"
    source.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors",
                 "rlfleet-tiny.json"):
        (source / name).write_text("{}")
    tensors = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4),
               "model.layers.0.mlp.up_proj.weight": torch.randn(8, 4)}
    return ExportState(step=step, tensors=tensors, config=config_with_dtype(CONFIG, torch.float32), source_dir=source)


def test_shard_plan_respects_the_limit_in_name_order():
    assert shard_plan({"b": 6, "a": 4, "c": 5}, 10) == [["a", "b"], ["c"]]
    assert shard_plan({"a": 30}, 10) == [["a"]]  # one tensor larger than a shard still gets written


def test_config_names_the_weight_dtype():
    config = config_with_dtype(CONFIG, torch.bfloat16)
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="dtype"):
        config_with_dtype(CONFIG, torch.int8)


def test_single_file_snapshot_is_sealed_and_valid(tmp_path):
    s = state(tmp_path)
    out = write_hf_snapshot(s, tmp_path / "step_3")
    names = {p.name for p in out.iterdir()}
    assert names == {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                     "generation_config.json", MANIFEST_NAME, MARKER_NAME}
    assert json.loads((out / MARKER_NAME).read_text())["step"] == 3
    loaded = load_file(out / "model.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in s.tensors.items())
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    validate_snapshot(out)


def test_sharded_snapshot_has_an_index_and_replaces_an_earlier_export(tmp_path):
    s = state(tmp_path)
    out = tmp_path / "step_3"
    write_hf_snapshot(s, out)  # one file first
    write_hf_snapshot(s, out, max_shard_bytes=100)
    index = json.loads((out / WEIGHTS_INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(s.tensors)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == sorted(set(index["weight_map"].values())) and len(files) == 3
    validate_snapshot(out)


def test_trainer_options_and_backends_are_checked(tmp_path):
    with pytest.raises(ValueError, match="lr"):
        TrainerOptions(lr=0)
    with pytest.raises(ValueError, match="dtype"):
        TrainerOptions(dtype="float64")
    with pytest.raises(ValueError, match="unknown trainer backend"):
        build_trainer("jax", tmp_path, lr=1e-3)
    with pytest.raises(FileNotFoundError, match="config.json"):
        build_trainer("torch", tmp_path, lr=1e-3)


def test_weight_files_are_hashed_as_written_and_read_like_any_safetensors(tmp_path: Path, monkeypatch):
    import rlfleet.snapshot.format as fmt
    from rlfleet.snapshot.writer import write_safetensors

    tensors = {"b": torch.randn(3, 5).to(torch.bfloat16), "a": torch.randn(7), "c": torch.arange(6).reshape(2, 3)}
    path = tmp_path / "x.safetensors"
    digest = write_safetensors(tensors, path, {"format": "pt"})
    assert digest == fmt.sha256_of(path)
    loaded = load_file(str(path))
    assert sorted(loaded) == ["a", "b", "c"] and all(torch.equal(loaded[n], tensors[n]) for n in tensors)
    assert set(fmt.read_safetensors_header(path)) == {"a", "b", "c"}

    hashed: list[str] = []
    real = fmt.sha256_of
    monkeypatch.setattr(fmt, "sha256_of", lambda p: hashed.append(p.name) or real(p))
    out = write_hf_snapshot(state(tmp_path), tmp_path / "snap")
    assert "model.safetensors" not in hashed  # sealed with the digest computed while writing
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["files"]["model.safetensors"]["sha256"] == real(out / "model.safetensors")
    hashed.clear()
    validate_snapshot(out, expected_step=3, verify_checksums=False)  # diskVerify: manifest
    assert hashed == []
    validate_snapshot(out, expected_step=3)  # diskVerify: full re-hashes
    assert "model.safetensors" in hashed


def test_manifest_validation_skips_hashing_and_full_catches_a_flipped_byte(tmp_path: Path):
    from rlfleet.snapshot.format import SnapshotInvalid

    out = write_hf_snapshot(state(tmp_path), tmp_path / "snap")
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, same header: only a hash can tell
    weights.write_bytes(bytes(data))
    validate_snapshot(out, expected_step=3, verify_checksums=False)
    with pytest.raises(SnapshotInvalid, match="export-time sha256"):
        validate_snapshot(out, expected_step=3)
