"""Weight snapshots on disk: the export contract and the check every snapshot passes before any
engine is told to load it.

Layout: `<root>/step_<N>/` holds the Hugging Face files (config.json, *.safetensors, tokenizer),
then `rlfleet-manifest.json` (per-file sha256 and size, the tensor table, the step), then the
`.complete` marker, written LAST. Both are written to a temporary name, fsynced and renamed, so a
reader never sees a half-written manifest or a marker before the files it vouches for.

Why validate: a real SGLang engine told to load a truncated, garbage or wrong-shape safetensors file
dies (no HTTP answer) instead of refusing with a 400; so `validate_snapshot` checks the marker, the
checksums written at export, every safetensors header (read from the file, no tensor is loaded) and
the tensor names, shapes and dtypes against the snapshot being served. A snapshot holds regular
files only: a symbolic link, or a manifest entry outside the directory, makes it invalid, and no file
is read through one.
"""
from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import stat
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from rlfleet.errors import RunError


class SnapshotInvalid(RunError):
    """A weight snapshot failed validation; no engine was told to load it.

    Not a ValueError: the `except ValueError` around file parsing here must not catch it by accident.
    """

    reason = "SnapshotInvalid"

    def __init__(self, snapshot_dir: str, problem: str):
        super().__init__(f"snapshot {snapshot_dir} is invalid: {problem}")
        self.snapshot_dir = snapshot_dir
        self.problem = problem


MANIFEST_NAME = "rlfleet-manifest.json"
MARKER_NAME = ".complete"
MANIFEST_FORMAT = "rlfleet-snapshot/1"
INDEX_NAME = "model.safetensors.index.json"
STEP_DIR = re.compile(r"^step_(\d+)$")
MAX_HEADER_BYTES = 100_000_000  # the safetensors library refuses a larger header
HASH_CHUNK = 1 << 20

# Bytes per element of each safetensors dtype.
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}

# config.json keys that fix the tensor shapes: a snapshot must agree with the served model on these.
SHAPE_KEYS = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "vocab_size", "head_dim", "tie_word_embeddings")


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    file: str

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "file": self.file}


@dataclass(frozen=True)
class FileInfo:
    size: int
    sha256: str


@dataclass
class Manifest:
    step: int
    files: dict[str, FileInfo]
    tensors: dict[str, TensorInfo]
    config: dict[str, Any] = field(default_factory=dict)  # the shape keys of config.json

    def to_json(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "step": self.step,
            "files": {name: {"size": f.size, "sha256": f.sha256} for name, f in sorted(self.files.items())},
            "tensors": {name: t.to_json() for name, t in sorted(self.tensors.items())},
            "config": self.config,
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> Manifest:
        try:
            return cls._parse(data)
        except ValueError as exc:
            raise SnapshotInvalid(where, f"{MANIFEST_NAME} is malformed: {exc}") from exc

    @classmethod
    def _parse(cls, data: Any) -> Manifest:
        """Raises ValueError naming the first field of the wrong type."""
        data = _object(data, "the manifest")
        if data.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        files = {name: FileInfo(size=_int(entry.get("size"), f"files[{name!r}].size"),
                                sha256=_str(entry.get("sha256"), f"files[{name!r}].sha256"))
                 for name, entry in _objects(data.get("files"), "files")}
        tensors = {name: TensorInfo(dtype=_str(entry.get("dtype"), f"tensors[{name!r}].dtype"),
                                    shape=_shape(entry.get("shape"), f"tensors[{name!r}].shape"),
                                    file=_str(entry.get("file"), f"tensors[{name!r}].file"))
                   for name, entry in _objects(data.get("tensors"), "tensors")}
        config = data.get("config")
        return cls(step=_int(data.get("step"), "step"), files=files, tensors=tensors,
                   config=dict(_object(config, "config")) if config else {})


# --- JSON of the expected types ------------------------------------------------------------------------

def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return "a string" if isinstance(value, str) else "null"


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} is {_kind(value)}, expected a JSON object")
    return value


def _objects(value: Any, what: str) -> list[tuple[str, dict[str, Any]]]:
    """The entries of an object whose values are all objects."""
    return [(name, _object(entry, f"{what}[{name!r}]")) for name, entry in _object(value, what).items()]


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} is {_kind(value)}, expected an integer")
    return value


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} is {_kind(value)}, expected a string")
    return value


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{what} is {_kind(value)}, expected a list of integers")
    return tuple(_int(d, f"{what}[{i}]") for i, d in enumerate(value))


def parse_json_object(raw: bytes, name: str, where: str) -> dict[str, Any]:
    """Pure: the JSON object in a snapshot file's bytes; SnapshotInvalid naming the file otherwise."""
    try:
        data = json.loads(raw)
    except ValueError as exc:  # UnicodeDecodeError included
        raise SnapshotInvalid(where, f"{name} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise SnapshotInvalid(where, f"{name} is {_kind(data)}, expected a JSON object")
    return data


# --- safetensors headers ------------------------------------------------------------------------------

def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and check one safetensors file's header against the file's size. Loads no tensor data.

    Raises ValueError saying what is wrong (truncated, garbage, inconsistent offsets).
    """
    size = path.stat().st_size
    if size < 8:
        raise ValueError(f"{size} bytes, too short for a safetensors header")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > MAX_HEADER_BYTES:
            raise ValueError(f"header length {header_len} is larger than the format allows (garbage file?)")
        if 8 + header_len > size:
            raise ValueError(f"header claims {header_len} bytes but the file has {size} (truncated?)")
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"header is not valid JSON ({exc}); garbage file?") from exc
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    data_len = size - 8 - header_len
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            _check_metadata(entry)
            continue
        try:
            entry = _object(entry, "entry")
            dtype = _str(entry.get("dtype"), "dtype")
            shape = _shape(entry.get("shape"), "shape")
            begin, end = _shape(entry.get("data_offsets"), "data_offsets")
        except ValueError as exc:  # also a data_offsets list that is not [begin, end]
            raise ValueError(f"tensor {name!r}: malformed header entry ({exc})") from exc
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
        if any(d < 0 for d in shape) or not 0 <= begin <= end:
            raise ValueError(f"tensor {name!r}: bad shape {list(shape)} or offsets [{begin}, {end}]")
        expected = math.prod(shape) * DTYPE_BYTES[dtype]
        if end - begin != expected:
            raise ValueError(f"tensor {name!r}: {end - begin} bytes of data for shape {list(shape)} {dtype} "
                             f"(needs {expected})")
        tensors[name] = TensorInfo(dtype=dtype, shape=shape, file=path.name)
        spans.append((begin, end, name))
    spans.sort()
    position = 0
    for begin, end, name in spans:
        if begin != position:
            raise ValueError(f"tensor {name!r} starts at byte {begin}, expected {position} (overlap or gap)")
        position = end
    if position != data_len:
        if position > data_len:
            raise ValueError(f"tensors need {position} bytes of data but the file holds {data_len} "
                             f"(truncated: {size} bytes)")
        raise ValueError(f"{data_len - position} bytes after the last tensor (file not fully covered)")
    return tensors


def _check_metadata(metadata: Any) -> None:
    """The safetensors library refuses a header whose __metadata__ is not a map of strings to strings."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("__metadata__ is not a JSON object of strings")


def weight_files(snapshot_dir: Path) -> list[Path]:
    return sorted(p for p in snapshot_dir.iterdir() if p.is_file() and p.suffix == ".safetensors")


def tensor_table(snapshot_dir: Path) -> dict[str, TensorInfo]:
    """All tensors of a model directory, from its safetensors headers."""
    where = str(snapshot_dir)
    files = weight_files(snapshot_dir)
    if not files:
        raise SnapshotInvalid(where, "no *.safetensors file")
    table: dict[str, TensorInfo] = {}
    for path in files:
        try:
            header = read_safetensors_header(path)
        except ValueError as exc:
            raise SnapshotInvalid(where, f"{path.name}: {exc}") from exc
        for name, info in header.items():
            if name in table:
                raise SnapshotInvalid(where, f"tensor {name!r} is in both {table[name].file} and {path.name}")
            table[name] = info
    return table


def shape_config(snapshot_dir: Path) -> dict[str, Any]:
    """The shape-defining keys of config.json ({} when there is none)."""
    path = snapshot_dir / "config.json"
    if not path.exists():
        return {}
    config = parse_json_object(path.read_bytes(), "config.json", str(snapshot_dir))
    text_config = config.get("text_config")
    if not isinstance(text_config, dict):
        text_config = {}
    return {k: config.get(k, text_config.get(k)) for k in SHAPE_KEYS if k in config or k in text_config}


def _open_regular(path: Path) -> BinaryIO:
    """Open a regular file for reading, never through a symbolic link (OSError otherwise)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with _open_regular(path) as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# --- export side --------------------------------------------------------------------------------------

def snapshot_dir_for(root: str | os.PathLike, step: int) -> Path:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return Path(root) / f"step_{step}"


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finalize_snapshot(snapshot_dir: str | os.PathLike, step: int,
                      digests: Mapping[str, str] | None = None) -> Manifest:
    """Seal an exported snapshot: write the manifest, then the `.complete` marker last.

    Call after `save_pretrained` (and the tokenizer) finished writing into snapshot_dir. Raises
    SnapshotInvalid if what was written is already unreadable (an export bug, caught at the source).
    `digests` (relative path -> sha256) are those the writer computed while writing: those files are
    not read again.
    """
    root = Path(snapshot_dir)
    if not root.is_dir():
        raise SnapshotInvalid(str(root), "not a directory")
    (root / MARKER_NAME).unlink(missing_ok=True)  # re-sealing: the old marker must not vouch for new files
    files: dict[str, FileInfo] = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            raise SnapshotInvalid(str(root), f"{path.relative_to(root).as_posix()} is a symbolic link "
                                             "(a snapshot holds regular files only)")
        if not path.is_file():
            continue
        rel = path.relative_to(root).as_posix()
        if rel in (MANIFEST_NAME, MARKER_NAME) or rel.endswith(".tmp"):
            continue
        known = (digests or {}).get(rel)
        files[rel] = FileInfo(size=path.stat().st_size, sha256=known if known is not None else sha256_of(path))
    manifest = Manifest(step=step, files=files, tensors=tensor_table(root), config=shape_config(root))
    manifest_bytes = (json.dumps(manifest.to_json(), indent=1) + "\n").encode()
    for path in root.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _write_atomically(root / MANIFEST_NAME, manifest_bytes)
    marker = {"step": step, "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest()}
    _write_atomically(root / MARKER_NAME, (json.dumps(marker) + "\n").encode())
    _fsync_dir(root)
    return manifest


# --- load side ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SnapshotReference:
    """What a new snapshot must match: the tensor table and shape config of the served model."""

    tensors: Mapping[str, TensorInfo]
    config: Mapping[str, Any]
    source: str

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> SnapshotReference:
        """From a sealed snapshot's manifest, or else from a model directory's headers and config."""
        root = Path(model_dir)
        manifest_path = root / MANIFEST_NAME
        if manifest_path.exists():
            data = parse_json_object(manifest_path.read_bytes(), MANIFEST_NAME, str(root))
            manifest = Manifest.from_json(data, str(root))
            return cls(tensors=manifest.tensors, config=manifest.config or shape_config(root), source=str(root))
        return cls(tensors=tensor_table(root), config=shape_config(root), source=str(root))

    @classmethod
    def from_manifest(cls, manifest: Manifest, source: str = "manifest") -> SnapshotReference:
        return cls(tensors=manifest.tensors, config=manifest.config, source=source)


def _names(items: Iterable[str], limit: int = 5) -> str:
    items = sorted(items)
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def compare_with_reference(tensors: Mapping[str, TensorInfo], config: Mapping[str, Any],
                           reference: SnapshotReference) -> str | None:
    """Pure: why a tensor table / config does not fit the reference, or None when it fits."""
    missing = set(reference.tensors) - set(tensors)
    extra = set(tensors) - set(reference.tensors)
    if missing:
        return f"tensors missing compared with {reference.source}: {_names(missing)}"
    if extra:
        return f"tensors not in {reference.source}: {_names(extra)}"
    wrong = [f"{name} {list(tensors[name].shape)} (served: {list(ref.shape)})"
             for name, ref in sorted(reference.tensors.items()) if tensors[name].shape != ref.shape]
    if wrong:
        return f"tensor shapes differ from {reference.source}: " + "; ".join(wrong[:5]) + (
            f" and {len(wrong) - 5} more" if len(wrong) > 5 else "")
    dtypes = [f"{name} {tensors[name].dtype} (served: {ref.dtype})"
              for name, ref in sorted(reference.tensors.items()) if tensors[name].dtype != ref.dtype]
    if dtypes:
        return f"tensor dtypes differ from {reference.source}: " + "; ".join(dtypes[:5]) + (
            f" and {len(dtypes) - 5} more" if len(dtypes) > 5 else "")
    differing = [f"{k}={config.get(k)!r} (served: {reference.config.get(k)!r})"
                 for k in SHAPE_KEYS if k in reference.config and k in config and config[k] != reference.config[k]]
    if differing:
        return "config.json differs from the served model: " + ", ".join(differing)
    return None


def listed_path_problem(rel: str) -> str | None:
    """Pure: why a file name in the manifest cannot name a file inside the snapshot, or None."""
    path = PurePosixPath(rel)
    if path.is_absolute():
        return f"{MANIFEST_NAME} lists an absolute path {rel!r}"
    if ".." in path.parts:
        return f"{MANIFEST_NAME} lists {rel!r}, which leaves the snapshot directory"
    return None


def _listed_file(root: Path, rel: str, where: str) -> Path:
    """A file the manifest lists, refused when it is a link or lies outside the snapshot directory."""
    problem = listed_path_problem(rel)
    if problem:
        raise SnapshotInvalid(where, problem)
    path = root / rel
    if path.is_symlink():
        raise SnapshotInvalid(where, f"{rel} is a symbolic link (a snapshot holds regular files only)")
    if not path.resolve().is_relative_to(root.resolve()):
        raise SnapshotInvalid(where, f"{rel} resolves outside the snapshot directory")
    return path


def _read_regular(path: Path) -> bytes:
    with _open_regular(path) as f:
        return f.read()


def validate_snapshot(snapshot_dir: str | os.PathLike,
                      reference: SnapshotReference | str | os.PathLike | None = None, *,
                      expected_step: int | None = None, verify_checksums: bool = True) -> Manifest:
    """Check a snapshot is complete, intact and fits the served model; return its manifest.

    Raises SnapshotInvalid with the precise problem (a file that cannot be read included). Reads
    headers and hashes files; loads no tensor and follows no symbolic link.
    """
    root = Path(snapshot_dir)
    where = str(root)
    if not root.is_dir():
        raise SnapshotInvalid(where, "no such directory")
    try:
        return _validate(root, where, reference, expected_step, verify_checksums)
    except OSError as exc:
        name = Path(exc.filename).name if isinstance(exc.filename, str) else "a file"
        raise SnapshotInvalid(where, f"cannot read {name}: {exc.strerror or exc}") from exc


def _validate(root: Path, where: str, reference: SnapshotReference | str | os.PathLike | None,
              expected_step: int | None, verify_checksums: bool) -> Manifest:
    links = [p.name for p in root.iterdir() if p.is_symlink()]
    if links:
        raise SnapshotInvalid(where, f"symbolic links in the snapshot (it holds regular files only): {_names(links)}")
    manifest = _sealed_manifest(root, where)
    if expected_step is not None and manifest.step != expected_step:
        raise SnapshotInvalid(where, f"holds step {manifest.step}, expected step {expected_step}")
    dir_match = STEP_DIR.match(root.name)
    if dir_match and int(dir_match.group(1)) != manifest.step:
        raise SnapshotInvalid(where, f"directory is {root.name} but the manifest says step {manifest.step}")

    # Sizes first: cheap, and the clearest message for a truncated or replaced file.
    listed = {rel: _listed_file(root, rel, where) for rel in sorted(manifest.files)}
    for rel, path in listed.items():
        info = manifest.files[rel]
        if not path.is_file():
            raise SnapshotInvalid(where, f"{rel} is missing (listed in {MANIFEST_NAME})")
        size = path.stat().st_size
        if size != info.size:
            hint = "truncated" if size < info.size else "grown"
            raise SnapshotInvalid(where,
                                  f"{rel} is {size} bytes but the export wrote {info.size} ({hint} since export)")
    unlisted = [p.name for p in weight_files(root) if p.name not in manifest.files]
    if unlisted:
        raise SnapshotInvalid(where, f"weight files not in {MANIFEST_NAME}: {_names(unlisted)}")

    tensors = tensor_table(root)  # every header parses and covers its file exactly
    if {n: t for n, t in tensors.items()} != dict(manifest.tensors):
        raise SnapshotInvalid(where, f"safetensors headers differ from the tensor table in {MANIFEST_NAME}")
    _check_index(root, where, tensors)

    if verify_checksums:
        for rel, path in listed.items():
            if sha256_of(path) != manifest.files[rel].sha256:
                raise SnapshotInvalid(where, f"{rel} does not match its export-time sha256 (corrupted since export)")

    if reference is not None:
        if not isinstance(reference, SnapshotReference):
            reference = SnapshotReference.from_dir(reference)
        problem = compare_with_reference(tensors, shape_config(root) or manifest.config, reference)
        if problem:
            raise SnapshotInvalid(where, problem)
    return manifest


def _sealed_manifest(root: Path, where: str) -> Manifest:
    """The manifest, once the marker says the export finished and vouches for it."""
    marker_path = root / MARKER_NAME
    manifest_path = root / MANIFEST_NAME
    if not marker_path.exists():
        raise SnapshotInvalid(where, f"no {MARKER_NAME} marker: the export did not finish")
    if not manifest_path.exists():
        raise SnapshotInvalid(where, f"{MARKER_NAME} present but {MANIFEST_NAME} is missing")
    manifest_bytes = _read_regular(manifest_path)
    marker = parse_json_object(_read_regular(marker_path), MARKER_NAME, where)
    data = parse_json_object(manifest_bytes, MANIFEST_NAME, where)
    if marker.get("manifest_sha256") != hashlib.sha256(manifest_bytes).hexdigest():
        raise SnapshotInvalid(where, f"{MANIFEST_NAME} does not match the checksum in {MARKER_NAME} "
                                     "(rewritten after sealing?)")
    manifest = Manifest.from_json(data, where)
    step = marker.get("step")
    if isinstance(step, bool) or step != manifest.step:
        raise SnapshotInvalid(where, f"marker step {step} != manifest step {manifest.step}")
    return manifest


def _check_index(root: Path, where: str, tensors: Mapping[str, TensorInfo]) -> None:
    """A sharded snapshot's index must name exactly the tensors of the weight files, each in its file."""
    index_path = root / INDEX_NAME
    if not index_path.exists():
        return
    index = parse_json_object(_read_regular(index_path), INDEX_NAME, where)
    try:
        weight_map = _object(index.get("weight_map"), "weight_map")
    except ValueError as exc:
        raise SnapshotInvalid(where, f"{INDEX_NAME} is malformed: {exc}") from exc
    misplaced = [n for n, f in weight_map.items() if n not in tensors or tensors[n].file != f]
    if misplaced or set(weight_map) != set(tensors):
        raise SnapshotInvalid(where, f"{INDEX_NAME} does not match the weight files "
                                     f"(e.g. {_names(misplaced or set(weight_map) ^ set(tensors), 3)})")
