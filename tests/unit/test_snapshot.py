"""Snapshot sealing and validation on real safetensors files (written with the safetensors library)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from rlfleet.snapshot.format import (
    MANIFEST_NAME,
    MARKER_NAME,
    SnapshotInvalid,
    SnapshotReference,
    finalize_snapshot,
    read_safetensors_header,
    snapshot_dir_for,
    validate_snapshot,
)

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8, "vocab_size": 16,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 16}


def tensors(hidden: int = 8, seed: int = 0, extra: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {
        "model.embed_tokens.weight": rng.standard_normal((16, hidden), dtype=np.float32),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((16, hidden), dtype=np.float32),
        "model.norm.weight": np.ones(hidden, dtype=np.float32),
    }
    if extra:
        out["lm_head.weight"] = rng.standard_normal((16, hidden), dtype=np.float32)
    return out


def write_model(directory: Path, *, hidden: int = 8, seed: int = 0, extra: bool = False, seal_step: int | None = None
                ) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors(hidden, seed, extra), str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(dict(CONFIG, hidden_size=hidden)))
    (directory / "tokenizer.json").write_text("{}")
    if seal_step is not None:
        finalize_snapshot(directory, seal_step)
    return directory


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return write_model(tmp_path / "base")


def test_sealed_snapshot_validates_against_the_base_model(tmp_path, base):
    snap = write_model(snapshot_dir_for(tmp_path / "snaps", 3), seed=1, seal_step=3)
    manifest = validate_snapshot(snap, base, expected_step=3)
    assert manifest.step == 3
    assert set(manifest.files) == {"model.safetensors", "config.json", "tokenizer.json"}
    assert manifest.tensors["model.embed_tokens.weight"].shape == (16, 8)
    marker = json.loads((snap / MARKER_NAME).read_text())
    assert marker["step"] == 3


def test_marker_is_written_after_the_manifest(tmp_path):
    snap = write_model(tmp_path / "step_1", seal_step=1)
    assert (snap / MARKER_NAME).stat().st_mtime_ns >= (snap / MANIFEST_NAME).stat().st_mtime_ns
    assert not any(p.name.endswith(".tmp") for p in snap.iterdir())


def test_missing_marker_means_unfinished_export(tmp_path, base):
    snap = write_model(tmp_path / "step_2")
    with pytest.raises(SnapshotInvalid, match="no .complete marker"):
        validate_snapshot(snap, base)


def test_truncated_weights_are_named_with_both_sizes(tmp_path, base):
    snap = write_model(tmp_path / "step_2", seal_step=2)
    path = snap / "model.safetensors"
    full = path.stat().st_size
    os.truncate(path, full // 2)
    with pytest.raises(SnapshotInvalid) as info:
        validate_snapshot(snap, base)
    assert f"model.safetensors is {full // 2} bytes but the export wrote {full} (truncated" in str(info.value)


def test_truncated_file_without_manifest_fails_on_its_header(tmp_path):
    path = write_model(tmp_path / "m") / "model.safetensors"
    os.truncate(path, path.stat().st_size - 10)
    with pytest.raises(ValueError, match="truncated"):
        read_safetensors_header(path)


def test_garbage_with_the_same_size_fails_the_checksum(tmp_path, base):
    snap = write_model(tmp_path / "step_2", seal_step=2)
    path = snap / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-4:] = b"\xff\xff\xff\xff"  # corrupt tensor bytes; header still parses
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotInvalid, match="does not match its export-time sha256"):
        validate_snapshot(snap, base)


def test_random_bytes_fail_the_header_check(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match="header"):
        read_safetensors_header(path)


def test_random_bytes_cannot_be_sealed(tmp_path):
    snap = write_model(tmp_path / "step_1")
    (snap / "model.safetensors").write_bytes(os.urandom(4096))
    with pytest.raises(SnapshotInvalid, match="model.safetensors"):
        finalize_snapshot(snap, 1)
    assert not (snap / MARKER_NAME).exists()


def test_wrong_shapes_are_caught_against_the_served_model(tmp_path, base):
    snap = write_model(tmp_path / "step_4", hidden=4, seal_step=4)  # self-consistent, wrong size
    with pytest.raises(SnapshotInvalid) as info:
        validate_snapshot(snap, base)
    assert "model.embed_tokens.weight [16, 4] (served: [16, 8])" in str(info.value)


def test_missing_or_extra_tensors_are_named(tmp_path, base):
    snap = write_model(tmp_path / "step_5", extra=True, seal_step=5)
    with pytest.raises(SnapshotInvalid, match="tensors not in .*lm_head.weight"):
        validate_snapshot(snap, base)
    with_head = write_model(tmp_path / "with_head", extra=True)
    snap2 = write_model(tmp_path / "step_6", seal_step=6)
    with pytest.raises(SnapshotInvalid, match="tensors missing .*lm_head.weight"):
        validate_snapshot(snap2, with_head)


def test_config_shape_keys_must_match(tmp_path, base):
    snap = write_model(tmp_path / "step_7")
    config = json.loads((snap / "config.json").read_text())
    (snap / "config.json").write_text(json.dumps(dict(config, num_attention_heads=4)))
    finalize_snapshot(snap, 7)
    with pytest.raises(SnapshotInvalid, match="num_attention_heads=4 .served: 2"):
        validate_snapshot(snap, base)


def test_manifest_rewritten_after_sealing_is_rejected(tmp_path, base):
    snap = write_model(tmp_path / "step_8", seal_step=8)
    data = json.loads((snap / MANIFEST_NAME).read_text())
    data["files"]["model.safetensors"]["size"] += 1
    (snap / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(SnapshotInvalid, match="rewritten after sealing"):
        validate_snapshot(snap, base)


def test_step_must_match_directory_and_expectation(tmp_path, base):
    snap = write_model(tmp_path / "step_9", seal_step=9)
    with pytest.raises(SnapshotInvalid, match="expected step 10"):
        validate_snapshot(snap, base, expected_step=10)
    misnamed = write_model(tmp_path / "step_11", seal_step=12)
    with pytest.raises(SnapshotInvalid, match="directory is step_11"):
        validate_snapshot(misnamed, base)


def test_unlisted_weight_file_is_rejected(tmp_path, base):
    snap = write_model(tmp_path / "step_13", seal_step=13)
    save_file({"x": np.zeros(2, dtype=np.float32)}, str(snap / "extra.safetensors"))
    with pytest.raises(SnapshotInvalid, match="weight files not in"):
        validate_snapshot(snap, base)


def test_reference_from_a_sealed_snapshot_uses_its_manifest(tmp_path, base):
    served = write_model(tmp_path / "step_1", seal_step=1)
    reference = SnapshotReference.from_dir(served)
    assert reference.tensors["model.norm.weight"].shape == (8,)
    nxt = write_model(tmp_path / "step_2", seed=2, seal_step=2)
    assert validate_snapshot(nxt, reference).step == 2


def test_missing_directory(tmp_path):
    with pytest.raises(SnapshotInvalid, match="no such directory"):
        validate_snapshot(tmp_path / "nope")
