"""Snapshot sealing and validation on real safetensors files (written with the safetensors library)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from rlfleet.snapshot.format import (
    INDEX_NAME,
    MANIFEST_NAME,
    MARKER_NAME,
    MAX_HEADER_BYTES,
    SnapshotInvalid,
    SnapshotReference,
    finalize_snapshot,
    read_safetensors_header,
    sha256_of,
    snapshot_dir_for,
    validate_snapshot,
)

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8, "vocab_size": 16,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 16}


def tensors(hidden: int = 8, seed: int = 0, extra: bool = False, dtype: type = np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {
        "model.embed_tokens.weight": rng.standard_normal((16, hidden), dtype=np.float32),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((16, hidden), dtype=np.float32),
        "model.norm.weight": np.ones(hidden, dtype=np.float32),
    }
    if extra:
        out["lm_head.weight"] = rng.standard_normal((16, hidden), dtype=np.float32)
    return {name: t.astype(dtype) for name, t in out.items()}


def write_model(directory: Path, *, hidden: int = 8, seed: int = 0, extra: bool = False, seal_step: int | None = None,
                dtype: type = np.float32) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors(hidden, seed, extra, dtype), str(directory / "model.safetensors"))
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


# --- hostile or malformed snapshots: always SnapshotInvalid, never another exception ----------------------

KEEP = object()


def reseal(snap: Path, manifest: object = KEEP) -> None:
    """Seal again by hand after files changed: sizes and hashes of every listed file, the marker last.

    `manifest` replaces the manifest's JSON (after the hashes are taken).
    """
    data = json.loads((snap / MANIFEST_NAME).read_text())
    for rel, entry in data["files"].items():
        path = snap / rel
        if path.is_file() and not path.is_symlink():
            entry.update(size=path.stat().st_size, sha256=sha256_of(path))
    raw = json.dumps(data if manifest is KEEP else manifest).encode()
    (snap / MANIFEST_NAME).write_bytes(raw)
    marker = {"step": data["step"], "manifest_sha256": hashlib.sha256(raw).hexdigest()}
    (snap / MARKER_NAME).write_text(json.dumps(marker))


def manifest_of(snap: Path) -> dict:
    return json.loads((snap / MANIFEST_NAME).read_text())


def problem_of(snap: Path, reference: SnapshotReference | Path | None = None) -> str:
    with pytest.raises(SnapshotInvalid) as info:
        validate_snapshot(snap, reference)
    assert info.value.snapshot_dir == str(snap)
    return info.value.problem


def raw_safetensors(path: Path, header: object, data: bytes = b"", header_len: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return path


def test_a_valid_snapshot_still_validates_unchanged(tmp_path, base):
    snap = write_model(tmp_path / "step_3", seed=1)
    sealed = finalize_snapshot(snap, 3)
    manifest = validate_snapshot(snap, base, expected_step=3)
    assert manifest == sealed
    assert validate_snapshot(snap, SnapshotReference.from_dir(snap)) == sealed
    assert manifest.config == CONFIG


def test_a_reference_model_directory_of_links_still_serves_as_reference(tmp_path):
    blobs = write_model(tmp_path / "blobs")  # a hub cache: the snapshot's files are links to blobs
    cached = tmp_path / "cache_snapshot"
    cached.mkdir()
    for path in blobs.iterdir():
        (cached / path.name).symlink_to(path)
    snap = write_model(tmp_path / "step_1", seed=1, seal_step=1)
    assert validate_snapshot(snap, cached).step == 1


def test_other_dtypes_are_named_with_both(tmp_path, base):
    snap = write_model(tmp_path / "step_4", dtype=np.float16, seal_step=4)  # names and shapes agree
    problem = problem_of(snap, base)
    assert problem.startswith(f"tensor dtypes differ from {base}: ")
    assert "model.norm.weight F16 (served: F32)" in problem
    assert problem_of(snap, SnapshotReference.from_dir(write_model(tmp_path / "step_1", seal_step=1))).startswith(
        "tensor dtypes differ")


@pytest.mark.parametrize(("listed", "problem"), [
    ("/etc/passwd", f"{MANIFEST_NAME} lists an absolute path '/etc/passwd'"),
    ("../outside.bin", f"{MANIFEST_NAME} lists '../outside.bin', which leaves the snapshot directory"),
    ("sub/../../outside.bin", f"{MANIFEST_NAME} lists 'sub/../../outside.bin', which leaves the snapshot directory"),
])
def test_manifest_paths_outside_the_snapshot_are_refused(tmp_path, listed, problem):
    (tmp_path / "outside.bin").write_bytes(b"secret")
    snap = write_model(tmp_path / "step_1", seal_step=1)
    data = manifest_of(snap)
    data["files"][listed] = {"size": 6, "sha256": hashlib.sha256(b"secret").hexdigest()}
    reseal(snap, data)
    assert problem_of(snap) == problem


def test_a_manifest_path_through_a_nested_link_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "vocab.txt").write_text("a b c")
    snap = write_model(tmp_path / "step_1", seal_step=1)
    (snap / "sub").mkdir()
    (snap / "sub" / "inner").symlink_to(outside)
    data = manifest_of(snap)
    data["files"]["sub/inner/vocab.txt"] = {"size": 5, "sha256": sha256_of(outside / "vocab.txt")}
    reseal(snap, data)
    assert problem_of(snap) == "sub/inner/vocab.txt resolves outside the snapshot directory"


def test_a_listed_file_that_is_a_nested_link_is_refused(tmp_path):
    snap = write_model(tmp_path / "step_1", seal_step=1)
    (snap / "sub").mkdir()
    (snap / "sub" / "chat_template.jinja").symlink_to(snap / "tokenizer.json")
    data = manifest_of(snap)
    data["files"]["sub/chat_template.jinja"] = dict(data["files"]["tokenizer.json"])
    reseal(snap, data)
    assert problem_of(snap) == "sub/chat_template.jinja is a symbolic link (a snapshot holds regular files only)"


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "config.json", MARKER_NAME, MANIFEST_NAME])
def test_files_that_are_links_are_refused_before_anything_is_read_through_them(tmp_path, name):
    snap = write_model(tmp_path / "step_1", seal_step=1)
    copy = tmp_path / "elsewhere"
    copy.write_bytes((snap / name).read_bytes())  # same bytes: only the link is wrong
    (snap / name).unlink()
    (snap / name).symlink_to(copy)
    assert problem_of(snap) == f"symbolic links in the snapshot (it holds regular files only): {name}"


def test_a_weight_file_linked_in_unlisted_is_refused(tmp_path, base):
    snap = write_model(tmp_path / "step_1", seal_step=1)
    (snap / "model-extra.safetensors").symlink_to(base / "model.safetensors")
    assert "model-extra.safetensors" in problem_of(snap)


def test_a_link_cannot_be_sealed(tmp_path):
    snap = write_model(tmp_path / "step_1")
    (snap / "tokenizer.json").unlink()
    (snap / "tokenizer.json").symlink_to(tmp_path)
    with pytest.raises(SnapshotInvalid, match="tokenizer.json is a symbolic link"):
        finalize_snapshot(snap, 1)
    assert not (snap / MARKER_NAME).exists()


WRONG_TYPES = [([1, 2], "a list"), ("text", "a string"), (3, "the number 3"), (None, "null"), (True, "a boolean")]


@pytest.mark.parametrize(("value", "kind"), WRONG_TYPES)
def test_config_of_the_wrong_json_type_is_named(tmp_path, base, value, kind):
    snap = write_model(tmp_path / "step_1")
    (snap / "config.json").write_text(json.dumps(value))
    with pytest.raises(SnapshotInvalid, match=f"config.json is {kind}, expected a JSON object"):
        finalize_snapshot(snap, 1)  # caught at the source
    (snap / "config.json").write_text(json.dumps(CONFIG))
    finalize_snapshot(snap, 1)
    (snap / "config.json").write_text(json.dumps(value))
    reseal(snap)  # a snapshot sealed by hand around a bad config.json
    assert problem_of(snap, base) == f"config.json is {kind}, expected a JSON object"
    with pytest.raises(SnapshotInvalid, match=f"config.json is {kind}, expected a JSON object"):
        SnapshotReference.from_dir(_plain_copy(snap, tmp_path / "plain"))


def _plain_copy(snap: Path, directory: Path) -> Path:
    """A model directory (no manifest) with snap's weights and config.json."""
    directory.mkdir()
    for name in ("model.safetensors", "config.json"):
        (directory / name).write_bytes((snap / name).read_bytes())
    return directory


@pytest.mark.parametrize(("value", "kind"), WRONG_TYPES)
def test_index_of_the_wrong_json_type_is_named(tmp_path, value, kind):
    snap = write_model(tmp_path / "step_1")
    (snap / INDEX_NAME).write_text(json.dumps(value))
    finalize_snapshot(snap, 1)  # the index is not read when sealing
    assert problem_of(snap) == f"{INDEX_NAME} is {kind}, expected a JSON object"


@pytest.mark.parametrize(("weight_map", "kind"), WRONG_TYPES)
def test_index_weight_map_of_the_wrong_type_is_named(tmp_path, weight_map, kind):
    snap = write_model(tmp_path / "step_1")
    (snap / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    finalize_snapshot(snap, 1)
    assert problem_of(snap) == f"{INDEX_NAME} is malformed: weight_map is {kind}, expected a JSON object"


def test_index_naming_files_of_the_wrong_type_does_not_match(tmp_path):
    snap = write_model(tmp_path / "step_1")
    names = tensors()
    (snap / INDEX_NAME).write_text(json.dumps({"weight_map": {n: ["model.safetensors"] for n in names}}))
    finalize_snapshot(snap, 1)
    assert problem_of(snap).startswith(f"{INDEX_NAME} does not match the weight files")


@pytest.mark.parametrize(("value", "kind"), WRONG_TYPES)
def test_manifest_of_the_wrong_json_type_is_named(tmp_path, value, kind):
    snap = write_model(tmp_path / "step_1", seal_step=1)
    reseal(snap, value)
    assert problem_of(snap) == f"{MANIFEST_NAME} is {kind}, expected a JSON object"
    with pytest.raises(SnapshotInvalid, match=f"{MANIFEST_NAME} is {kind}, expected a JSON object"):
        SnapshotReference.from_dir(snap)


@pytest.mark.parametrize(("change", "problem"), [
    (lambda m: m.update(step="1"), "step is a string, expected an integer"),
    (lambda m: m.pop("step"), "step is null, expected an integer"),
    (lambda m: m.update(files=["model.safetensors"]), "files is a list, expected a JSON object"),
    (lambda m: m["files"].update({"config.json": "abc"}), "files['config.json'] is a string, expected a JSON object"),
    (lambda m: m["files"]["config.json"].update(size="12"),
     "files['config.json'].size is a string, expected an integer"),
    (lambda m: m["files"]["config.json"].update(sha256=7),
     "files['config.json'].sha256 is the number 7, expected a string"),
    (lambda m: m.update(tensors=3), "tensors is the number 3, expected a JSON object"),
    (lambda m: m["tensors"].update({"model.norm.weight": 4}),
     "tensors['model.norm.weight'] is the number 4, expected a JSON object"),
    (lambda m: m["tensors"]["model.norm.weight"].update(shape="8"),
     "tensors['model.norm.weight'].shape is a string, expected a list of integers"),
    (lambda m: m["tensors"]["model.norm.weight"].update(shape=[8.5]),
     "tensors['model.norm.weight'].shape[0] is the number 8.5, expected an integer"),
    (lambda m: m["tensors"]["model.norm.weight"].update(dtype=["F32"]),
     "tensors['model.norm.weight'].dtype is a list, expected a string"),
    (lambda m: m.update(config=["hidden_size", 8]), "config is a list, expected a JSON object"),
])
def test_manifest_fields_of_the_wrong_type_are_named(tmp_path, base, change, problem):
    snap = write_model(tmp_path / "step_1", seal_step=1)
    data = manifest_of(snap)
    change(data)
    reseal(snap, data)
    assert problem_of(snap, base) == f"{MANIFEST_NAME} is malformed: {problem}"


@pytest.mark.parametrize(("value", "kind"), WRONG_TYPES)
def test_marker_of_the_wrong_json_type_is_named(tmp_path, value, kind):
    snap = write_model(tmp_path / "step_1", seal_step=1)
    (snap / MARKER_NAME).write_text(json.dumps(value))
    assert problem_of(snap) == f"{MARKER_NAME} is {kind}, expected a JSON object"


def test_marker_fields_of_the_wrong_type(tmp_path):
    snap = write_model(tmp_path / "step_1", seal_step=1)
    sha = hashlib.sha256((snap / MANIFEST_NAME).read_bytes()).hexdigest()
    (snap / MARKER_NAME).write_text(json.dumps({"step": 1, "manifest_sha256": [sha]}))
    assert "does not match the checksum in .complete" in problem_of(snap)
    (snap / MARKER_NAME).write_text(json.dumps({"step": True, "manifest_sha256": sha}))
    assert problem_of(snap) == "marker step True != manifest step 1"


def test_garbage_json_files_are_named(tmp_path):
    snap = write_model(tmp_path / "step_1", seal_step=1)
    (snap / MARKER_NAME).write_bytes(b"\xff\xfe not json")
    assert problem_of(snap).startswith(f"{MARKER_NAME} is not valid JSON: ")


def test_a_file_that_cannot_be_read_is_invalid(tmp_path):
    snap = write_model(tmp_path / "step_1", seal_step=1)
    (snap / MARKER_NAME).unlink()
    (snap / MARKER_NAME).mkdir()
    assert problem_of(snap) == f"cannot read {MARKER_NAME}: not a regular file"


def test_header_length_above_the_cap_is_refused(tmp_path):
    path = raw_safetensors(tmp_path / "model.safetensors", {}, header_len=MAX_HEADER_BYTES + 1)
    with pytest.raises(ValueError, match=f"header length {MAX_HEADER_BYTES + 1} is larger than the format allows"):
        read_safetensors_header(path)
    assert MAX_HEADER_BYTES == 100_000_000  # the safetensors library's limit


def test_header_length_beyond_the_file_is_refused(tmp_path):
    path = raw_safetensors(tmp_path / "model.safetensors", {}, header_len=1000)
    with pytest.raises(ValueError, match=r"header claims 1000 bytes but the file has 10 \(truncated\?\)"):
        read_safetensors_header(path)


@pytest.mark.parametrize(("header_len", "problem"), [
    (MAX_HEADER_BYTES + 1, f"header length {MAX_HEADER_BYTES + 1} is larger than the format allows (garbage file?)"),
    (2**64 - 1, f"header length {2**64 - 1} is larger than the format allows (garbage file?)"),
    (10**6, "header claims 1000000 bytes but the file has {size} (truncated?)"),
])
def test_a_sealed_snapshot_with_a_bad_header_length_is_invalid(tmp_path, header_len, problem):
    snap = write_model(tmp_path / "step_1", seal_step=1)
    path = snap / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", header_len)
    path.write_bytes(bytes(data))
    reseal(snap)  # sizes and hashes agree: only the header is wrong
    assert problem_of(snap) == "model.safetensors: " + problem.format(size=len(data))


@pytest.mark.parametrize(("entry", "problem"), [
    ([1, 2], "entry is a list, expected a JSON object"),
    ({"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}, "dtype is a list, expected a string"),
    ({"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}, "shape is a string, expected a list of integers"),
    ({"dtype": "F32", "shape": [2], "data_offsets": "08"}, "data_offsets is a string, expected a list of integers"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4, 8]}, "too many values to unpack"),
    ({"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}, "shape[0] is the number 2.0, expected an integer"),
])
def test_header_entries_of_the_wrong_type_are_refused(tmp_path, entry, problem):
    path = raw_safetensors(tmp_path / "model.safetensors", {"w": entry}, b"\0" * 8)
    with pytest.raises(ValueError, match=re.escape(f"tensor 'w': malformed header entry ({problem}")):
        read_safetensors_header(path)


@pytest.mark.parametrize("metadata", [["pt"], {"format": 1}, "pt"])
def test_header_metadata_must_map_strings_to_strings(tmp_path, metadata):
    path = raw_safetensors(tmp_path / "model.safetensors", {"__metadata__": metadata})
    with pytest.raises(ValueError, match="__metadata__ is not a JSON object of strings"):
        read_safetensors_header(path)
