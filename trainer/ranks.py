"""One trainer, many ranks: rank 0 leads, every other rank follows its commands.

The run loop (and everything else that drives a trainer) lives in rank 0 only. It holds a
`LeadingTrainer`: each `train_step` first hands the step's whole batch to every rank (a broadcast on
a gloo group of its own, so a rank may wait through a long rollout without a collective timing out),
then every rank trains on its data-parallel replica's part of it; `state_for_export` (and so
`export_hf`) has every rank join the gather of the tensor-parallel shards, and only rank 0 writes the
snapshot. The other ranks run `follow` until rank 0 says stop.

A command whose part rank 0 did not finish (it raised, or still runs in another thread) may hold the
other ranks inside its collectives; rank 0 then sends nothing more (a broadcast would wait for them as
long as the collective's timeout) and the other ranks end with rank 0's process: its exit fails their
collectives, and the launcher stops the group when it exits non-zero.

    init_process_group(device)                     # in each rank, from torchrun's environment
    trainer = build_trainer(..., parallel=layout)  # each rank its shards
    if rank == 0: lead = LeadingTrainer(trainer); ...; lead.close()
    else: follow(trainer)
"""
from __future__ import annotations

import contextlib
import os
import pickle
import threading
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from rlfleet.snapshot.writer import ExportState, write_hf_snapshot
from rlfleet.trainer import grpo
from rlfleet.trainer.base import Trainer

# Rank 0 may spend a whole rollout (or an eval) between two commands.
COMMAND_TIMEOUT = timedelta(days=7)
# Collectives inside a step (gradients, gathers) are bounded by the group's own timeout.
STEP_TIMEOUT = timedelta(minutes=30)


def rank_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun sets them; (0, 1, 0) outside a launch."""
    env = os.environ
    return int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0"))


def init_process_group(device: str) -> str:
    """Join the launcher's rendezvous (env://): gloo on CPU, NCCL on CUDA (one GPU per local rank).

    Returns the device this rank trains on ("cpu" or "cuda:<local rank>").
    """
    import torch
    import torch.distributed as dist

    rank, world, local = rank_env()
    if device.startswith("cuda"):
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", rank=rank, world_size=world,
                                timeout=STEP_TIMEOUT)
    return device


class _Commands:
    """The broadcast channel from rank 0 to every rank (a gloo group, whatever the training backend).

    A command is pickled into a fixed-capacity frame (its length, then its bytes): one broadcast
    carries a step's batch, where `broadcast_object_list` makes two (the size, then the bytes). A
    command larger than the frame sends its remainder in a second broadcast.
    """

    # bytes; a quickstart-sized batch pickles to ~25 KiB. On gloo a broadcast of up to 32 KiB takes about
    # as long as one of 1 KiB (0.18 ms here), one of 64 KiB half as long again.
    FRAME = 32 * 1024
    _LENGTH = 8  # the frame's header: the pickle's length, little-endian

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        group = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
        if not isinstance(group, dist.ProcessGroup):  # new_group's non-member marker; every rank is a member
            raise RuntimeError("this rank is not in the trainer's command group")
        self.group = group
        self._frame = torch.zeros(self.FRAME, dtype=torch.uint8)

    def send(self, *command: Any) -> None:
        import torch
        import torch.distributed as dist

        payload = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        room = self.FRAME - self._LENGTH
        head, rest = payload[:room], payload[room:]
        frame = self._frame.numpy()
        frame[: self._LENGTH] = memoryview(len(payload).to_bytes(self._LENGTH, "little"))
        frame[self._LENGTH : self._LENGTH + len(head)] = memoryview(head)
        dist.broadcast(self._frame, src=0, group=self.group)
        if rest:
            dist.broadcast(torch.frombuffer(bytearray(rest), dtype=torch.uint8), src=0, group=self.group)

    def receive(self) -> tuple[Any, ...]:
        import torch
        import torch.distributed as dist

        dist.broadcast(self._frame, src=0, group=self.group)
        frame = self._frame.numpy()
        size = int.from_bytes(frame[: self._LENGTH].tobytes(), "little")
        room = self.FRAME - self._LENGTH
        payload = frame[self._LENGTH : self._LENGTH + min(size, room)].tobytes()
        if size > room:
            rest = torch.empty(size - room, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)
            payload += rest.numpy().tobytes()
        command = pickle.loads(payload)
        if not isinstance(command, tuple) or not command:
            raise RuntimeError(f"malformed trainer command from rank 0 ({size} bytes)")
        return command


class BatchShards:
    """A step's batch as rank 0 hands it out: each data-parallel replica's part is pickled on its own
    (when the command is), so a rank unpickles only its replica's part (a quarter of the batch at
    dataParallelSize 4); with it what every replica reports of the whole batch (its response tokens,
    sample count and reward mean)."""

    def __init__(self, batch: Sequence[grpo.Sample], data: int):
        from rlfleet.trainer.parallel import ParallelLayout

        layout = ParallelLayout(data=data)
        self._held: list[list[grpo.Sample]] | None = [layout.data_shard(batch, r) for r in range(data)]
        self._parts: list[bytes] = []
        self.step_tokens = grpo.response_tokens(batch)
        self.samples = len(batch)
        self.reward_mean = sum(s.reward for s in batch) / len(batch)

    def part(self, data_rank: int) -> list[grpo.Sample]:
        """Replica `data_rank`'s samples (unpickled here, on a rank that received them)."""
        if self._held is not None:
            return self._held[data_rank]
        return pickle.loads(self._parts[data_rank])

    def __getstate__(self) -> dict[str, Any]:
        assert self._held is not None, "only the rank that split the batch sends it"
        parts = [pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL) for part in self._held]
        return {**self.__dict__, "_held": None, "_parts": parts}


def train_part(trainer: Trainer, shards: BatchShards) -> dict[str, float]:
    """This rank's share of one step: its data-parallel replica's part of the batch, then one step.

    Sample count and reward mean are of the whole batch, as one rank would report them.
    """
    from rlfleet.trainer.parallel import ParallelLayout

    layout: ParallelLayout = trainer.options.parallel
    rank, _, _ = rank_env()
    _, data_rank, _ = layout.coords(rank)
    metrics = trainer.train_step(shards.part(data_rank), step_tokens=shards.step_tokens,
                                 largest_part=-(-shards.samples // layout.data))
    metrics["samples"] = float(shards.samples)
    metrics["reward_mean"] = shards.reward_mean
    return metrics


class LeadingTrainer:
    """Rank 0's trainer: what a single-rank Trainer offers, each call run by every rank.

    Attributes that involve no other rank (step, model_dir, hf_config, options, ...) are the local
    trainer's.
    """

    def __init__(self, trainer: Trainer):
        self.local = trainer
        self._commands = _Commands()
        self._closed = False
        self._reports: Any = None  # checkpoint shard reports, made at the first checkpoint
        # One command at a time, whichever thread calls (the loop trains, eval copies weights).
        self._lock = threading.Lock()
        self._unfinished: str | None = None  # a command whose part rank 0 did not finish

    @contextlib.contextmanager
    def _every_rank(self, *command: Any) -> Iterator[None]:
        """Send `command`, then run rank 0's part of it (the body) under the lock. A body that raises
        leaves the command unfinished: the other ranks may be inside its collectives for good."""
        with self._lock:
            if self._unfinished is not None:
                raise RuntimeError(f"trainer rank 0 failed in its part of {self._unfinished!r}; the other "
                                   "ranks may still be inside it, so no command can reach them")
            self._unfinished = command[0]
            self._commands.send(*command)
            yield
            self._unfinished = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)

    @property
    def world(self) -> int:
        return self.local.options.parallel.world

    def train_step(self, batch: Sequence[grpo.Sample]) -> dict[str, float]:
        if not batch:
            raise ValueError("train_step needs at least one sample")
        shards = BatchShards(batch, self.local.options.parallel.data)
        with self._every_rank("train", shards):
            return train_part(self.local, shards)

    def state_for_export(self, into: Mapping[str, Any] | None = None) -> ExportState:
        with self._every_rank("state"):
            return self.local.state_for_export(into)  # the other ranks' part of the gather: theirs to drop

    def export_hf(self, out_dir: str | os.PathLike, step: int | None = None) -> Path:
        state = self.state_for_export()
        if step is not None and step != state.step:
            state = ExportState(step=step, tensors=state.tensors, config=state.config, source_dir=state.source_dir)
        return write_hf_snapshot(state, out_dir)

    def logits(self, input_ids: Any) -> Any:
        with self._every_rank("logits", input_ids):
            return self.local.logits(input_ids)

    # --- checkpoints (trainer/rank_checkpoints.py) ---------------------------------------------

    def capture_checkpoint(self, directory: str | os.PathLike) -> dict[str, Any]:
        """Every rank copies its state off the device and writes its shard into `directory` beside the
        next steps; rank 0's state is returned (its shard is `write_checkpoint_shard`'s)."""
        from rlfleet.trainer import rank_checkpoints

        with self._every_rank("checkpoint", str(directory)):
            self._shard_reports.group()
            return rank_checkpoints.capture(self.local)

    def write_checkpoint_shard(self, directory: str | os.PathLike, state: dict[str, Any]) -> list:
        """Rank 0's shard written; every rank's report (rank order). Blocks: a thread beside the loop."""
        from rlfleet.trainer import rank_checkpoints

        return rank_checkpoints.write_and_report(directory, state, self._shard_reports)

    def restore_checkpoint(self, info: Any) -> None:
        """Every rank restores its shard of the (validated) checkpoint `info`."""
        from rlfleet.trainer import checkpoint as ckpt

        with self._every_rank("restore", str(info.directory), info.step, dict(info.meta)):
            ckpt.restore_rank(self.local, info, 0)

    @property
    def _shard_reports(self) -> Any:
        if self._reports is None:
            from rlfleet.trainer.rank_checkpoints import ShardReports

            self._reports = ShardReports()
        return self._reports

    def greedy_generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                        stop_ids: Sequence[int] = ()) -> list[int]:
        return Trainer.greedy_generate(self, prompt_ids, max_new_tokens, stop_ids)  # type: ignore[arg-type]  # its logits are every rank's

    def close(self) -> None:
        """Release the other ranks (they return from `follow`) when they wait for a command. Idempotent;
        never waits for them: while a command rank 0 did not finish (it raised, or still runs in another
        thread) may hold them inside its collectives, no stop is sent (a gloo send waits for its
        receiver, here as long as the collective's timeout). They end with this process then, which
        exits non-zero (it failed, or was stopped by a signal): the launcher stops the group."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if not self._closed and self._unfinished is None:
                self._closed = True
                self._commands.send("stop")
        finally:
            self._lock.release()


def follow(trainer: Trainer) -> int:
    """Run rank 0's commands on this rank until it says stop; returns the steps trained."""
    from rlfleet.trainer.rank_checkpoints import FollowerCheckpoints

    commands = _Commands()
    checkpoints = FollowerCheckpoints(trainer)
    while True:
        command = commands.receive()
        kind = command[0]
        if kind == "checkpoint":
            checkpoints.checkpoint(command[1])
        elif kind == "restore":
            checkpoints.restore(*command[1:])
        elif kind == "train":
            train_part(trainer, command[1])
        elif kind == "state":
            trainer.state_for_export()
        elif kind == "logits":
            trainer.logits(command[1])
        elif kind == "stop":
            checkpoints.wait()
            return trainer.step
        else:
            raise RuntimeError(f"unknown trainer command {kind!r} from rank 0")
