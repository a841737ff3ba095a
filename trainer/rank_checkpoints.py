"""Checkpoints of a trainer of several ranks: every rank copies its state off the device when rank 0
says so, writes its own shard in a thread beside the next steps, and reports it to rank 0.

    rank 0 (LeadingTrainer)                          every other rank (follow)
    ("checkpoint", dir) sent; own state captured     state captured; a thread writes its shard
    thread: own shard; reports gathered; finalize     ... and reports it (size, sha256 or the error)

The reports travel over a gloo group of their own (made at the first checkpoint, by every rank in
the same order), so a write beside the next training steps never meets their collectives. Rank 0
writes `COMPLETE` only when every rank reported its shard written (trainer/checkpoint.py), so a
checkpoint is complete only when every shard is. Resuming, each rank restores its own shard
(`restore`).
"""
from __future__ import annotations

import os
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

from rlfleet.trainer import checkpoint as ckpt
from rlfleet.trainer.base import Trainer

# Writing a shard of a large model to a network volume takes a while; a rank that died is seen by
# the launcher long before this.
REPORT_TIMEOUT = timedelta(hours=2)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


class ShardReports:
    """The gloo group the ranks' shard reports travel on (made on first use, by every rank)."""

    def __init__(self) -> None:
        self._group: Any = None

    def group(self) -> Any:
        if self._group is None:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo", timeout=REPORT_TIMEOUT)
        return self._group

    def gather(self, report: dict[str, Any]) -> list[dict[str, Any] | None]:
        """Every rank's report, in rank order (on rank 0; an empty list on the others)."""
        import torch.distributed as dist

        group = self.group()
        rank = _rank()
        reports: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(report, reports, dst=0, group=group)
        return list(reports or [])


def capture(trainer: Trainer) -> dict[str, Any]:
    """This rank's shard state, off the device: weights and optimizer only on data-parallel rank 0."""
    return ckpt.capture_state(trainer, weights=ckpt.writes_weights(_rank(), trainer.options.parallel))


def write_and_report(directory: str | os.PathLike, state: dict[str, Any], reports: ShardReports) -> list:
    """Write this rank's shard, then report it (or the error) to rank 0; rank 0 gets every report."""
    try:
        report: dict[str, Any] = ckpt.write_shard(directory, _rank(), state)
    except Exception as exc:  # reported to rank 0, which leaves the checkpoint incomplete
        report = {"error": f"{type(exc).__name__}: {exc}"}
    return reports.gather(report)


class FollowerCheckpoints:
    """A following rank's side: capture on command, write in a thread, one write at a time."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.reports = ShardReports()
        self._writer: threading.Thread | None = None

    def checkpoint(self, directory: str) -> None:
        self.wait()  # rank 0 waits for the previous checkpoint's reports before it asks again
        self.reports.group()  # made now, in command order on every rank
        state = capture(self.trainer)
        self._writer = threading.Thread(target=write_and_report, args=(directory, state, self.reports),
                                        name="checkpoint-shard", daemon=True)
        self._writer.start()

    def restore(self, directory: str, step: int, meta: dict[str, Any]) -> None:
        """Rank 0 validated the checkpoint (checksums) and checked its layout before it sent this."""
        ckpt.restore_rank(self.trainer, ckpt.CheckpointInfo(Path(directory), step, meta), _rank())

    def wait(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None
