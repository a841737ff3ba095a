"""Pure decisions of the broadcast weight sync: buckets, rank offsets, step bounds, checksum comparison.

- Tensors travel in flattened buckets (SGLang's `load_format: flattened_bucket`: one uint8 buffer per
  bucket, tensors back to back in the order named). A bucket holds one dtype only, so every tensor in it
  starts at a multiple of its item size, and at most `max_bytes` (a tensor larger than that is a bucket
  of its own). Buckets lie back to back in one shared buffer, each at a 64-byte boundary.
- The trainer's broadcasting rank is 0; engine i's TP ranks follow those of engine i-1.
- Every protocol step is bounded by `transferTimeoutSeconds` (T): control calls (pause, begin, end,
  read-back, destroy) by a short share of it, the group's rendezvous by a longer one, each bucket by its
  share of T by bytes (never below what a healthy peer always meets); the whole transfer (begin .. end)
  by T itself, so a step late in it gets at most what is left of T.
- Checksums are SGLang's (`/weights_checker`, CPU engines): the first 8 bytes of the sha256 of a tensor's
  raw bytes, as 16 hex digits, per parameter name, of what each engine rank holds (`served_weights`).
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlfleet.orchestrator.fleet.served_weights import EngineLayout, served_tensors, tied_aliases
from rlfleet.sglang.engine import RankChecksums
from rlfleet.snapshot.format import DTYPE_BYTES, TensorInfo
from rlfleet.snapshot.writer import SAFETENSORS_DTYPES

BUCKET_ALIGN = 64
CONTROL_TIMEOUT_S = 30.0
JOIN_TIMEOUT_S = 60.0
BUCKET_FLOOR_S = 10.0
SLOWEST_BYTES_PER_S = 50 * 1024**2  # a bucket slower than this is a wedged peer
LOAD_FORMAT = "flattened_bucket"
# Safetensors dtype codes under the torch names a TensorSpec carries (the snapshot writer's table, inverted).
TORCH_DTYPE_NAMES = {code: name.removeprefix("torch.") for name, code in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # torch dtype name without "torch.", as SGLang takes it ("float32")
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    index: int
    start: int  # byte offset of the bucket in the shared buffer
    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def end(self) -> int:
        return self.start + self.nbytes

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    @property
    def dtypes(self) -> list[str]:
        return [t.dtype for t in self.tensors]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(t.shape) for t in self.tensors]


def _aligned(offset: int) -> int:
    return (offset + BUCKET_ALIGN - 1) // BUCKET_ALIGN * BUCKET_ALIGN


def plan_buckets(tensors: Sequence[TensorSpec], max_bytes: int) -> list[Bucket]:
    """Buckets of one dtype each, tensors in the given order within a dtype, at most max_bytes each."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    by_dtype: dict[str, list[TensorSpec]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    groups: list[list[TensorSpec]] = []
    for specs in by_dtype.values():
        current: list[TensorSpec] = []
        used = 0
        for t in specs:
            if current and used + t.nbytes > max_bytes:
                groups.append(current)
                current, used = [], 0
            current.append(t)
            used += t.nbytes
        if current:
            groups.append(current)
    buckets: list[Bucket] = []
    offset = 0
    for index, group in enumerate(groups):
        bucket = Bucket(index=index, start=_aligned(offset), tensors=tuple(group))
        buckets.append(bucket)
        offset = bucket.end
    return buckets


def buffer_bytes(buckets: Sequence[Bucket]) -> int:
    return buckets[-1].end if buckets else 0


def rank_offsets(tp_sizes: Sequence[int]) -> tuple[list[int], int]:
    """Each engine's first rank in the group, and the group's world size (rank 0 is the trainer)."""
    offsets = []
    next_rank = 1
    for size in tp_sizes:
        if size < 1:
            raise ValueError(f"an engine has at least one rank, got {size}")
        offsets.append(next_rank)
        next_rank += size
    return offsets, next_rank


@dataclass(frozen=True)
class StepBounds:
    """Seconds each protocol step may take, from `transferTimeoutSeconds` (T)."""

    transfer_timeout_s: float

    @property
    def control_s(self) -> float:
        return min(self.transfer_timeout_s, CONTROL_TIMEOUT_S)

    @property
    def join_s(self) -> float:
        return min(self.transfer_timeout_s, JOIN_TIMEOUT_S)

    @property
    def transfer_s(self) -> float:
        """The whole transfer: begin, every bucket, end."""
        return self.transfer_timeout_s

    def bucket_s(self, nbytes: int, transfer_bytes: int) -> float:
        """A bucket of `nbytes` in a transfer of `transfer_bytes`: its share of T by bytes (raising T gives
        a slow link more time), never below `bucket_floor_s` (a tiny bucket of a small transfer gets no
        mere milliseconds), never beyond T."""
        share = self.transfer_timeout_s * nbytes / transfer_bytes if transfer_bytes > 0 else self.transfer_timeout_s
        return min(self.transfer_timeout_s, max(bucket_floor_s(nbytes), share))

    def within_transfer(self, step_s: float, elapsed_s: float) -> float:
        """A step's bound once `elapsed_s` of the transfer have passed: its own, cut to what is left of T
        (<= 0: nothing is left, the transfer has overrun)."""
        return min(step_s, self.transfer_s - elapsed_s)


def bucket_floor_s(nbytes: int) -> float:
    """What a healthy peer always meets: a fixed allowance plus the bytes at a pessimistic rate."""
    return BUCKET_FLOOR_S + nbytes / SLOWEST_BYTES_PER_S


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_specs(tensors: Mapping[str, Any]) -> list[TensorSpec]:
    """TensorSpecs of named torch tensors, in name order."""
    return [TensorSpec(name, dtype_name(t.dtype), tuple(int(d) for d in t.shape), t.numel() * t.element_size())
            for name, t in sorted(tensors.items())]


def table_specs(tensors: Mapping[str, TensorInfo]) -> list[TensorSpec] | None:
    """The TensorSpecs `tensor_specs` gives for the weights of a snapshot's tensor table (names, safetensors
    dtypes, shapes); None when a dtype has no torch name here."""
    specs = []
    for name, info in sorted(tensors.items()):
        dtype = TORCH_DTYPE_NAMES.get(info.dtype)
        if dtype is None:
            return None
        specs.append(TensorSpec(name, dtype, tuple(info.shape), math.prod(info.shape) * DTYPE_BYTES[info.dtype]))
    return specs


def tensor_checksum(tensor: Any) -> str:
    """SGLang's CPU checksum of one tensor (`weight_checker._hash_tensor`)."""
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(memoryview(flat.numpy())).digest()[:8].hex()


def checksums(tensors: Mapping[str, Any], *, dtype: str | None = None, device: str = "cpu",
              layout: EngineLayout | None = None, rank: int = 0) -> dict[str, str]:
    """The checksums tensor-parallel rank `rank` of an engine of `layout` (None: the tensors as they are)
    reports when it serves these tensors: in its dtype (None: as they are); a CUDA engine hashes on the
    GPU with SGLang's own kernel, so that one is used (ImportError without it)."""
    import torch

    target = getattr(torch, dtype) if dtype else None

    def cast(t: Any) -> Any:
        return t.to(target) if target is not None and t.dtype != target else t

    served = served_tensors(tensors, layout, rank) if layout is not None else iter(tensors.items())
    if device.startswith("cuda"):
        from sglang.srt.managers.mm_utils import tensor_hash

        sums = {name: f"{tensor_hash(cast(t).to(device)):016x}" for name, t in served}
    else:
        sums = {name: tensor_checksum(cast(t)) for name, t in served}
    if layout is not None:  # the same tensor under another name: hashed once
        sums.update({alias: sums[name] for alias, name in tied_aliases(tensors, layout).items()})
    return sums


@dataclass(frozen=True)
class ChecksumVerdict:
    compared: int
    mismatched: tuple[str, ...]
    unmatched: tuple[str, ...]  # trainer tensors the engine lists under no matching name

    @property
    def ok(self) -> bool:
        return self.compared > 0 and not self.mismatched

    def describe(self, limit: int = 5) -> str:
        if self.mismatched:
            names = ", ".join(self.mismatched[:limit]) + (" ..." if len(self.mismatched) > limit else "")
            return f"{len(self.mismatched)} of {self.compared} tensor(s) differ from the trainer's: {names}"
        if self.compared == 0:
            return "no served tensor matches a trainer tensor by name"
        return f"{self.compared} tensor(s) equal the trainer's"


def _served_name(name: str, served: Mapping[str, str], suffixes: Mapping[str, list[str]]) -> str | None:
    if name in served:
        return name
    candidates = suffixes.get(name, [])
    return candidates[0] if len(candidates) == 1 else None


def compare_checksums(expected: Mapping[str, str], served: Mapping[str, str]) -> ChecksumVerdict:
    """Compare the trainer's checksums (HF names) with one engine rank's (its parameter names, which may
    carry a prefix, e.g. `model.` of a wrapper); a tied weight the engine does not list is unmatched."""
    suffixes: dict[str, list[str]] = {}
    for served_name in served:
        parts = served_name.split(".")
        for i in range(1, len(parts)):
            suffixes.setdefault(".".join(parts[i:]), []).append(served_name)
    compared = 0
    mismatched: list[str] = []
    unmatched: list[str] = []
    for name in sorted(expected):
        other = _served_name(name, served, suffixes)
        if other is None:
            unmatched.append(name)
            continue
        compared += 1
        if served[other] != expected[name]:
            mismatched.append(name)
    return ChecksumVerdict(compared, tuple(mismatched), tuple(unmatched))


def compare_engine(expected: Sequence[Mapping[str, str]], ranks: Sequence[RankChecksums]) -> ChecksumVerdict | str:
    """Compare every rank of one engine with the trainer's checksums of what that rank holds (`expected`,
    by tensor-parallel rank), as one verdict; or why the engine cannot be judged (a rank of an unknown
    place or of another layout, or one that matched nothing)."""
    if not ranks:
        return "the engine answered no rank"
    compared = 0
    mismatched: list[str] = []
    unmatched: set[str] = set()
    for rank in ranks:
        if rank.tp_rank is None or rank.tp_size != len(expected) or not 0 <= rank.tp_rank < len(expected):
            return f"an engine rank of tensor-parallel rank {rank.tp_rank} of {rank.tp_size} (expected {len(expected)})"
        if rank.dp_size > 1:
            return f"an engine rank of attention data parallel {rank.dp_size} (weights laid out otherwise)"
        verdict = compare_checksums(expected[rank.tp_rank], rank.checksums)
        if verdict.compared == 0:
            return f"tensor-parallel rank {rank.tp_rank}: {verdict.describe()}"
        compared += verdict.compared
        where = f" (tp rank {rank.tp_rank})" if len(expected) > 1 else ""
        mismatched += [name + where for name in verdict.mismatched]
        unmatched.update(verdict.unmatched)
    return ChecksumVerdict(compared, tuple(mismatched), tuple(sorted(unmatched)))


def staying_after_scale_down(alive: Sequence[int], replicas: int, blamed: Iterable[int]) -> list[int] | None:
    """The slots to broadcast to again when a broadcast over `alive` failed because engines were scaled
    away under way (slots >= `replicas`: the operator ends their pods mid-collective), or None when the
    failure is not that: nothing was scaled away, none stays, or a staying engine is blamed (it timed
    out or went away itself), which the failure's own handling (fallback, dead marks) is for."""
    staying = [slot for slot in alive if slot < replicas]
    if not staying or len(staying) == len(alive) or set(blamed) & set(staying):
        return None
    return staying


def verification_due(sync_index: int, every: int) -> bool:
    """Is the `sync_index`-th verifiable sync (1-based) verified at rate `every` (0: never)?"""
    return every > 0 and sync_index % every == 0


def count_verifiable(verifiable_syncs: int, carries_tensors: bool) -> int:
    """The count `verification_due` takes, after one more sync: only a sync that carries the trainer's
    tensors can be verified, so only such a sync counts (a recovery or launch re-sync carries none, and
    counting it would shift which steps get verified)."""
    return verifiable_syncs + 1 if carries_tensors else verifiable_syncs


def names_of(buckets: Iterable[Bucket]) -> list[str]:
    return [name for b in buckets for name in b.names]
