"""Write a Hugging Face model directory (safetensors + config.json + tokenizer) from CPU tensors.

The trainer hands over an `ExportState` (weights already off the device, HF names); writing it
touches no trainer state, so it can run in a thread beside the next training step. The snapshot
is sealed last by the orchestrator's `finalize_snapshot` (manifest with checksums, then the
`.complete` marker), so a reader never sees a half-written one.

Weight files are written by `write_safetensors`, which hashes the bytes as it writes them: each file
is hashed once, and never read back for it (validation re-hashes only with `diskVerify: full`).
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import struct
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfleet.snapshot.format import MARKER_NAME, finalize_snapshot

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
# Files of the source model directory that belong in every snapshot unchanged.
TOKENIZER_FILE_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "vocab*",
    "merges.txt",
    "*.tiktoken",
    "chat_template*",
)
_DTYPE_NAMES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


@dataclass(frozen=True)
class ExportState:
    """Weights of one training step, detached from the trainer."""

    step: int
    tensors: Mapping[str, Any]  # HF names -> contiguous CPU tensors, no tied duplicates
    config: Mapping[str, Any]  # config.json content
    source_dir: Path  # the tokenizer files are copied from here


def config_with_dtype(config: Mapping[str, Any], dtype: Any) -> dict[str, Any]:
    """config.json content saying which dtype the weights are stored in."""
    name = _DTYPE_NAMES.get(str(dtype))
    if name is None:
        raise ValueError(f"cannot export weights of dtype {dtype}")
    out = dict(config)
    out["torch_dtype"] = name  # transformers 4.x key
    out["dtype"] = name  # transformers 5.x key
    return out


def shard_plan(sizes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Group tensor names (in name order) into shards of at most max_shard_bytes (one tensor may exceed it)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name in sorted(sizes):
        size = sizes[name]
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


SAFETENSORS_DTYPES = {"torch.float64": "F64", "torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16",
                     "torch.int64": "I64", "torch.int32": "I32", "torch.int16": "I16", "torch.int8": "I8",
                     "torch.uint8": "U8", "torch.bool": "BOOL"}
WRITE_CHUNK = 64 * 1024**2


def write_safetensors(tensors: Mapping[str, Any], path: Path, metadata: Mapping[str, str]) -> str:
    """Write a safetensors file (tensors in name order, header padded to 8 bytes as the format asks)
    and return its sha256, computed from the bytes as they are written."""
    import torch

    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    names = sorted(tensors)
    for name in names:
        t = tensors[name]
        dtype = SAFETENSORS_DTYPES.get(str(t.dtype))
        if dtype is None:
            raise ValueError(f"cannot write {name} of dtype {t.dtype} to safetensors")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    digest = hashlib.sha256()
    # Hashing runs in a thread of its own beside the writes (both release the GIL): a file costs the
    # longer of the two instead of their sum. The hash still takes the pieces in order, one at a time.
    with open(path, "wb") as f, ThreadPoolExecutor(1, thread_name_prefix="snapshot-hash") as hasher:
        hashed: Future[None] | None = None

        def put(piece: Any) -> None:
            nonlocal hashed
            if hashed is not None:
                hashed.result()
            hashed = hasher.submit(digest.update, piece)
            f.write(piece)

        put(struct.pack("<Q", len(raw)) + raw)
        for name in names:
            flat = tensors[name].detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            view = memoryview(flat)
            for start in range(0, len(view), WRITE_CHUNK):
                put(view[start:start + WRITE_CHUNK])
        if hashed is not None:
            hashed.result()
    return digest.hexdigest()


def write_hf_snapshot(
    state: ExportState, out_dir: str | os.PathLike, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> Path:
    """Write the HF directory into out_dir (created; an old marker there is removed first), then finalise."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER_NAME).unlink(missing_ok=True)
    # A re-export may shard differently: weights of an earlier export must not linger.
    for old in [*out.glob("*.safetensors"), out / WEIGHTS_INDEX_NAME]:
        old.unlink(missing_ok=True)
    tensors = {name: t.contiguous() for name, t in state.tensors.items()}
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    shards = shard_plan(sizes, max_shard_bytes)
    metadata = {"format": "pt"}
    digests: dict[str, str] = {}
    if len(shards) == 1:
        digests[WEIGHTS_NAME] = write_safetensors(tensors, out / WEIGHTS_NAME, metadata)
    else:
        weight_map = {}
        for i, names in enumerate(shards, start=1):
            file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            digests[file_name] = write_safetensors({n: tensors[n] for n in names}, out / file_name, metadata)
            weight_map.update({n: file_name for n in names})
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (out / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(dict(state.config), indent=2, sort_keys=True) + "\n")
    for path in sorted(Path(state.source_dir).iterdir()):
        if path.is_file() and any(fnmatch.fnmatch(path.name, p) for p in TOKENIZER_FILE_PATTERNS):
            shutil.copyfile(path, out / path.name)
    # Engines in other containers read the volume: files must be world-readable.
    for path in out.iterdir():
        if path.is_file():
            path.chmod(0o644)
    finalize_snapshot(out, state.step, digests)
    return out
