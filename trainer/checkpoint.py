"""Trainer checkpoints on disk: one directory per step, one shard per rank, a marker written last.

    <root>/step_00000006/
        rank_00000.pt       this rank's state (torch.save): model, optimizer, RNG, step
        rank_00000.done     {"size", "sha256"} of the shard, written by its rank once the shard is on disk
        meta.json           identity (run, model, backend, layout), step, weight version, shards
        run_state.json      the orchestrator's state (data position, eval, summary so far), from rank 0
        COMPLETE            the checksums of every file above; written last, by rank 0, once every
                            rank's `.done` is there. Without it the checkpoint does not exist.

Each rank writes only its own shard (`write_shard`); rank 0 writes the rest (`finalize`) once every
rank has reported its shard written (`check_shard_reports`). Data-parallel replicas hold the same
weights and optimizer state: only data-parallel rank 0 of each tensor/pipeline position writes them
(`writes_weights`), every rank its RNG states and step; a rank resumes its weights from the shard of
`source_rank`. A checkpoint resumes only on its own layout (`check_identity` names both). Files are
written to a temporary name, flushed and renamed, so a killed writer leaves a directory without
`COMPLETE`, never a truncated file under a final name. `newest_complete` validates the newest first
and falls back, naming why it skipped each (missing marker, checksum, truncated shard, ...).

Everything here blocks (disk and hashing): the run loop calls it through asyncio.to_thread. Only
`capture_state`, the copy off the device, holds the training loop.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfleet.trainer.parallel import ParallelLayout

FORMAT = 1
MARKER = "COMPLETE"
META = "meta.json"
RUN_STATE = "run_state.json"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointInvalid(Exception):
    """A checkpoint directory that cannot be resumed from; the message says why."""


class CheckpointMismatch(Exception):
    """A complete checkpoint of another run, model, backend or parallel layout."""


@dataclass(frozen=True)
class Identity:
    """What a checkpoint must match to be resumed: the run, its initial model, backend and layout."""

    run: str
    model_path: str
    backend: str
    world_size: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def layout(self) -> str:
        return describe_layout(self.to_dict())

    def mismatches(self, other: Mapping[str, Any]) -> list[str]:
        """The fields where `other` (a checkpoint's identity) differs, as 'name: theirs != ours'."""
        return [f"{key}: checkpoint {other.get(key)!r} != this run {value!r}"
                for key, value in self.to_dict().items() if other.get(key) != value]


@dataclass(frozen=True)
class CheckpointInfo:
    """A validated, complete checkpoint."""

    directory: Path
    step: int
    meta: dict[str, Any]

    @property
    def weight_version(self) -> str:
        return str(self.meta["weight_version"])

    def shard(self, rank: int) -> Path:
        return self.directory / shard_name(rank)

    def run_state(self) -> dict[str, Any]:
        return json.loads((self.directory / RUN_STATE).read_text())


_LAYOUT_KEYS = ("world_size", "tensor_parallel", "pipeline_parallel")


def describe_layout(identity: Mapping[str, Any]) -> str:
    """'tensor 2 x pipeline 1 x data 1 (2 ranks)' of an identity (or a checkpoint's meta)."""
    layout = layout_of(identity)
    return f"tensor {layout.tensor} x pipeline {layout.pipeline} x data {layout.data} ({layout.world} ranks)"


def layout_of(identity: Mapping[str, Any]) -> ParallelLayout:
    """The parallel layout of an identity's fields (or a checkpoint's meta)."""
    world, tp, pp = (int(identity.get(k) or 1) for k in _LAYOUT_KEYS)
    return ParallelLayout(tensor=tp, pipeline=pp, data=max(world // (tp * pp), 1))


def writes_weights(rank: int, layout: ParallelLayout) -> bool:
    """Whether this rank's shard holds model and optimizer state: data-parallel rank 0 only (the
    replicas' are the same: their gradients are summed before every step)."""
    return layout.coords(rank)[1] == 0


def source_rank(rank: int, layout: ParallelLayout) -> int:
    """The rank whose shard holds `rank`'s weights and optimizer state: same tensor-parallel rank and
    pipeline stage, data-parallel rank 0."""
    tp_rank, _, stage = layout.coords(rank)
    return tp_rank + stage * layout.tensor * layout.data


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _done_name(rank: int) -> str:
    return f"rank_{rank:05d}.done"


# --- the state of one rank ---------------------------------------------------------------------


def _to_cpu(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_cpu(v) for v in value)
    return value


def rng_state() -> dict[str, Any]:
    import torch

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": list(cuda)}


def set_rng_state(state: Mapping[str, Any]) -> None:
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def capture_state(trainer: Any, *, weights: bool = True) -> dict[str, Any]:
    """This rank's trainer state, copied off the device (the only part that holds the training loop).

    The model's state dict under the backend's own names (tensors only: megatron's `_extra_state`
    entries carry nothing for the local layer spec), the optimizer's state dict (moments, step
    counts, learning rates of the param groups), the RNG states and the step. Without `weights`
    (a data-parallel replica other than the first): the RNG states and the step only.
    """
    import torch

    # Every rank, in this order: each is a collective where the backend shards that state.
    shards = trainer.gather_optimizer_shards()
    whole = trainer.checkpoint_state(keep=weights)
    if whole is None:
        return {"format": FORMAT, "backend": trainer.backend, "step": trainer.step, "rng": rng_state()}
    with torch.no_grad():
        tensors = {k: v.detach().to("cpu", copy=True) for k, v in whole[0].items()}
        optim = _to_cpu(whole[1])
    state = {"format": FORMAT, "backend": trainer.backend, "step": trainer.step, "model": tensors,
             "optimizer": optim, "optimizer_format": trainer.optimizer_format, "rng": rng_state()}
    if shards is not None:
        state["optimizer_shards"] = _to_cpu(shards)
    return state


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in a captured state."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def restore_state(trainer: Any, state: Mapping[str, Any], weights: Mapping[str, Any] | None = None) -> None:
    """Load a shard's state into a trainer built from the same model and options. `weights`: the shard
    holding the model and optimizer state when `state` (this rank's: RNG, step) holds none."""
    weights = state if weights is None else weights
    for shard in (state, weights):
        if shard.get("backend") != trainer.backend:
            raise CheckpointMismatch(f"the shard is of backend {shard.get('backend')!r}, the trainer "
                                     f"{trainer.backend!r}")
    if "model" not in weights:
        raise CheckpointMismatch("the shard holds no weights (a data-parallel replica's): restore from its "
                                 "source rank's shard")
    written = weights.get("optimizer_format", "torch")
    if written != trainer.optimizer_format:
        raise CheckpointMismatch(f"the shard's optimizer state is {written!r}, this trainer's is "
                                 f"{trainer.optimizer_format!r} (megatron's distributed optimizer runs on GPUs, "
                                 "AdamW on CPU): resume on the kind of device that wrote the checkpoint")
    missing, unexpected = trainer.load_checkpoint_state(weights["model"], weights["optimizer"])
    if missing or unexpected:
        raise CheckpointMismatch(f"the shard's weights do not fit the model: missing {missing[:5]}, "
                                 f"unexpected {unexpected[:5]}")
    trainer.scatter_optimizer_shards(weights.get("optimizer_shards"))  # every rank: a collective where sharded
    set_rng_state(state["rng"])
    trainer.step = int(state["step"])


# --- writing -------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, write: Callable[[Any], None], mode: str = "wb") -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open(mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _write_json(path: Path, content: Mapping[str, Any]) -> None:
    text = json.dumps(content, indent=1)
    _write_atomic(path, lambda f: f.write(text), mode="w")


def _file_entry(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def write_shard(directory: str | os.PathLike, rank: int, state: Mapping[str, Any]) -> dict[str, Any]:
    """Write this rank's shard and then its `.done` record; returns the record (size, sha256)."""
    import torch

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shard = directory / shard_name(rank)
    _write_atomic(shard, lambda f: torch.save(dict(state), f))
    entry = _file_entry(shard)
    _write_json(directory / _done_name(rank), entry)
    return entry


def check_shard_reports(step: int, reports: list[Mapping[str, Any] | None], world: int) -> None:
    """CheckpointInvalid unless every rank reported its shard written (a report per rank, in rank
    order: the shard's {"size", "sha256"}, or {"error": why}). Pure."""
    if len(reports) != world:
        raise CheckpointInvalid(f"step_{step:08d}: {len(reports)} of {world} ranks reported their shard")
    failed = [f"rank {rank}: {report.get('error') if report else 'no report'}"
              for rank, report in enumerate(reports) if not report or "error" in report or "sha256" not in report]
    if failed:
        raise CheckpointInvalid(f"step_{step:08d}: the shards of {len(failed)} rank(s) are not written: "
                                + "; ".join(failed))


def prepare_step_dir(root: str | os.PathLike, step: int) -> Path:
    """The directory of step `step`'s checkpoint, emptied before any rank writes into it: what is there
    is a leftover of a writer killed before its marker, or one a resume skipped as broken (a run
    resumes from its newest intact checkpoint, so it writes only steps after it)."""
    directory = step_dir(root, step)
    if directory.exists():
        shutil.rmtree(directory)
    return directory


def finalize(directory: str | os.PathLike, *, identity: Identity, step: int, weight_version: str,
             run_state: Mapping[str, Any]) -> CheckpointInfo:
    """Rank 0, after every rank's `write_shard`: meta, run state, then the marker (last).

    Raises CheckpointInvalid when a rank's shard is not done (the checkpoint stays incomplete)."""
    directory = Path(directory)
    files: dict[str, Any] = {}
    for rank in range(identity.world_size):
        done = directory / _done_name(rank)
        if not done.is_file():
            raise CheckpointInvalid(f"{directory.name}: the shard of rank {rank} is not written")
        files[shard_name(rank)] = json.loads(done.read_text())
    meta = {"format": FORMAT, "step": step, "weight_version": weight_version, **identity.to_dict(),
            "shards": [shard_name(r) for r in range(identity.world_size)]}
    for name, content in ((META, meta), (RUN_STATE, dict(run_state))):
        _write_json(directory / name, content)
        files[name] = _file_entry(directory / name)
    _fsync_dir(directory)
    _write_json(directory / MARKER, {"step": step, "files": files})
    _fsync_dir(directory)
    return CheckpointInfo(directory, step, meta)


def write_checkpoint(root: str | os.PathLike, *, identity: Identity, step: int, weight_version: str,
                     state: Mapping[str, Any], run_state: Mapping[str, Any]) -> CheckpointInfo:
    """A single-rank checkpoint: the shard, then meta, run state and the marker. A leftover directory
    of the same step (a writer killed before its marker) is replaced."""
    if identity.world_size != 1:
        raise ValueError("write_checkpoint writes one rank; ranks call write_shard, rank 0 then finalize")
    directory = step_dir(root, step)
    if directory.exists() and not (directory / MARKER).exists():
        shutil.rmtree(directory)
    write_shard(directory, 0, state)
    return finalize(directory, identity=identity, step=step, weight_version=weight_version, run_state=run_state)


# --- reading -------------------------------------------------------------------------------------


def validate(directory: str | os.PathLike) -> CheckpointInfo:
    """The checkpoint in `directory` if it is complete and intact; else CheckpointInvalid saying why."""
    directory = Path(directory)
    match = _STEP_DIR.match(directory.name)
    if match is None:
        raise CheckpointInvalid(f"{directory.name}: not a checkpoint directory")
    marker = directory / MARKER
    if not marker.is_file():
        raise CheckpointInvalid(f"{directory.name}: incomplete (no {MARKER} marker)")
    try:
        record = json.loads(marker.read_text())
        files = record["files"]
        meta = json.loads((directory / META).read_text())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointInvalid(f"{directory.name}: unreadable marker or meta ({exc})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointInvalid(f"{directory.name}: format {meta.get('format')!r}, this version reads {FORMAT}")
    if int(meta.get("step", -1)) != int(match.group(1)) or record.get("step") != meta.get("step"):
        raise CheckpointInvalid(f"{directory.name}: its marker and meta name step {meta.get('step')}")
    for name in [*meta.get("shards", []), META, RUN_STATE]:
        entry = files.get(name)
        path = directory / name
        if entry is None:
            raise CheckpointInvalid(f"{directory.name}: {name} is not in the marker")
        if not path.is_file():
            raise CheckpointInvalid(f"{directory.name}: {name} is missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise CheckpointInvalid(f"{directory.name}: {name} is {size} bytes, {entry['size']} were written "
                                    "(truncated or overwritten)")
        if _sha256(path) != entry["sha256"]:
            raise CheckpointInvalid(f"{directory.name}: {name} does not match its checksum (corrupt)")
    return CheckpointInfo(directory, int(meta["step"]), meta)


def step_dirs(root: str | os.PathLike) -> list[Path]:
    """Checkpoint directories under root, newest step first (complete or not)."""
    found = []
    with contextlib.suppress(FileNotFoundError):
        for entry in Path(root).iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and entry.is_dir() and not entry.is_symlink():
                found.append((int(match.group(1)), entry))
    return [path for _, path in sorted(found, reverse=True)]


def newest_complete(root: str | os.PathLike) -> tuple[CheckpointInfo | None, list[str]]:
    """The newest complete, intact checkpoint under root (or None) and why each newer one was skipped."""
    skipped: list[str] = []
    for directory in step_dirs(root):
        try:
            return validate(directory), skipped
        except CheckpointInvalid as exc:
            skipped.append(str(exc))
    return None, skipped


def load_shard(info: CheckpointInfo, rank: int = 0) -> dict[str, Any]:
    import torch

    return torch.load(info.shard(rank), map_location="cpu", weights_only=True)


def restore_rank(trainer: Any, info: CheckpointInfo, rank: int) -> None:
    """Rank `rank` of the checkpoint's layout restored: its own shard (RNG, step) and the weights and
    optimizer state of its source rank's shard."""
    source = source_rank(rank, layout_of(info.meta))
    state = load_shard(info, rank)
    restore_state(trainer, state, state if source == rank else load_shard(info, source))


def check_identity(info: CheckpointInfo, identity: Identity) -> None:
    """CheckpointMismatch when the checkpoint is of another run, model, backend or layout."""
    differences = identity.mismatches(info.meta)
    if not differences:
        return
    message = f"{info.directory} is not a checkpoint of this run: " + "; ".join(differences)
    if any(info.meta.get(k) != getattr(identity, k) for k in _LAYOUT_KEYS):
        message += (f". It was written by a trainer of {describe_layout(info.meta)}, this run's trainer is "
                    f"{identity.layout()} (spec.trainer tensorParallelSize x pipelineParallelSize x "
                    "dataParallelSize): a checkpoint resumes only on its own layout (no resharding); resume "
                    "with that layout, or start again with another spec.checkpoint.path")
    raise CheckpointMismatch(message)


def prune(root: str | os.PathLike, keep: int) -> list[Path]:
    """Remove all but the `keep` newest complete checkpoints, and incomplete directories older than the
    newest complete one (a write in progress is always newer). Returns what was removed."""
    removed: list[Path] = []
    complete = 0
    for directory in step_dirs(root):
        is_complete = (directory / MARKER).is_file()
        if is_complete:
            complete += 1
        if (is_complete and complete > keep) or (not is_complete and complete > 0):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed
