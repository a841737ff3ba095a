"""The GPU check's multi-rank part (2 or more GPUs): megatron and torch FSDP on NCCL ranks, against one rank.

Each layout (megatron pipeline 2 and data parallel 2, torch data parallel 2 as FSDP replicas) trains the
same batch for a few steps in ranks the project's launcher starts (one GPU per rank, NCCL), then
checkpoints (every rank writes its shard; on GPUs the distributed optimizer's state is gathered onto
data-parallel rank 0, FSDP's shards are gathered whole), trains on, restores the checkpoint and trains
the same steps again: the steps after the restore must repeat the steps after the checkpoint. One rank
of the same backend on one GPU gives the reference losses.

`rank_entry` runs in every rank (trainer/launch.py); `check_layouts` is called by check.py.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BEFORE, AFTER = 2, 2  # steps before the checkpoint, and after it (trained twice)
# (backend, (tensor, pipeline, data)); "torch-fsdp": the torch backend, its replicas sharded (FSDP2)
LAYOUTS = (("megatron", (1, 2, 1)), ("megatron", (1, 1, 2)), ("torch-fsdp", (1, 1, 2)))


def rank_entry(model_dir: str, layout: tuple[int, int, int], device_kind: str, out_dir: str,
               backend: str = "megatron") -> dict[str, Any] | None:
    """BEFORE steps, a checkpoint, AFTER steps, the restore, the AFTER steps again; rank 0 returns the losses."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from trainer_step import make_batch

    from rlfleet.trainer import checkpoint as ckpt
    from rlfleet.trainer.base import build_trainer
    from rlfleet.trainer.parallel import ParallelLayout
    from rlfleet.trainer.ranks import LeadingTrainer, follow, init_process_group, rank_env

    parallel = ParallelLayout(*layout)
    rank = rank_env()[0]
    device = init_process_group(device_kind)
    name, _, mode = backend.partition("-")
    trainer = build_trainer(name, model_dir, lr=1e-4, seed=0, parallel=parallel, device=device,
                            data_parallel_mode=mode or "ddp")
    if rank != 0:
        follow(trainer)
        return None
    lead = LeadingTrainer(trainer)
    try:
        batch = make_batch(16, 8, 0)
        before = [lead.train_step(batch)["loss"] for _ in range(BEFORE)]
        identity = ckpt.Identity(run="gpu-check", model_path=model_dir, backend=name, world_size=parallel.world,
                                 tensor_parallel=parallel.tensor, pipeline_parallel=parallel.pipeline)
        directory = ckpt.prepare_step_dir(out_dir, lead.step)
        started = time.perf_counter()
        state = lead.capture_checkpoint(directory)
        ckpt.check_shard_reports(lead.step, lead.write_checkpoint_shard(directory, state), parallel.world)
        info = ckpt.finalize(directory, identity=identity, step=lead.step, weight_version=str(lead.step),
                             run_state={})
        checkpoint_s = time.perf_counter() - started
        after = [lead.train_step(batch)["loss"] for _ in range(AFTER)]
        lead.restore_checkpoint(ckpt.validate(info.directory))
        again = [lead.train_step(batch)["loss"] for _ in range(AFTER)]
        optimizer_format = state.get("optimizer_format")
    finally:
        lead.close()
    return {"before": before, "after": after, "again": again, "checkpoint_s": checkpoint_s,
            "optimizer_format": optimizer_format,
            "sharded": "optimizer_shards" in state or bool(getattr(trainer, "fsdp", False))}  # FSDP: gathered whole


def one_rank_entry(model_dir: str, device_kind: str, backend: str = "megatron") -> list[float]:
    """The reference: one rank, the same batch, BEFORE + AFTER steps."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from trainer_step import make_batch

    from rlfleet.trainer.base import build_trainer
    from rlfleet.trainer.ranks import init_process_group

    device = init_process_group(device_kind)
    trainer = build_trainer(backend, model_dir, lr=1e-4, seed=0, device=device)
    batch = make_batch(16, 8, 0)
    return [trainer.train_step(batch)["loss"] for _ in range(BEFORE + AFTER)]


def check_layouts(model_dir: Path, device_kind: str, say: Any, tolerance: float) -> None:
    """Every layout of LAYOUTS against one rank; raises AssertionError naming the first that differs."""
    from rlfleet.trainer.launch import launch_ranks

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        references: dict[str, list[float]] = {}
        for backend in sorted({b.partition("-")[0] for b, _ in LAYOUTS}):
            (references[backend],) = launch_ranks(one_rank_entry, (str(model_dir), device_kind, backend), world=1,
                                                  log_dir=work / f"logs-one-{backend}").values()
            say(f"ranks: one {backend} rank losses",
                f"{[round(x, 5) for x in references[backend]]} ({time.perf_counter() - started:.1f} s)")
            started = time.perf_counter()
        for backend, layout in LAYOUTS:
            reference = references[backend.partition("-")[0]]
            name = "{}-tp{}-pp{}-dp{}".format(backend, *layout)
            world = layout[0] * layout[1] * layout[2]
            started = time.perf_counter()
            by_rank = launch_ranks(rank_entry, (str(model_dir), layout, device_kind, str(work / name), backend),
                                   world=world, log_dir=work / f"logs-{name}")
            result = by_rank[0]
            losses = result["before"] + result["after"]
            worst = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses, reference, strict=True))
            repeat = max(abs(a - b) for a, b in zip(result["again"], result["after"], strict=True))
            say(f"ranks: {name} ({world} ranks)",
                f"losses {[round(x, 5) for x in losses]}, max relative difference to one rank {worst:.2e}; "
                f"checkpoint {result['checkpoint_s']:.2f} s ({result['optimizer_format']}, sharded optimizer "
                f"state {'gathered' if result['sharded'] else 'not gathered'}); after the restore the steps "
                f"repeat within {repeat:.2e}; {time.perf_counter() - started:.1f} s")
            assert worst < tolerance, f"{name}: the losses differ from one rank's by {worst:.2e} (relative)"
            assert repeat < tolerance * max(abs(x) for x in result["after"]), \
                f"{name}: the steps after the restore differ from those after the checkpoint by {repeat:.2e}"
