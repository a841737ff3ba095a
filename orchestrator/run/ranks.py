"""`rlfleet run FILE` with a trainer of several ranks: this process launches them, rank 0 runs the run.

When `spec.trainer` asks for more than one rank (tensor x pipeline x data parallel), `rlfleet run`
checks the layout against the model (before anything starts), then becomes the ranks' launcher
(torch.distributed's elastic agent, trainer/launch.py): rank 0 runs the whole run (the loop, the engines,
the router, the watchdog, eval) exactly as a single-rank run does, every other rank builds its part of
the trainer and follows rank 0's steps (trainer/ranks.py). Output of rank 0 is shown on the terminal;
every rank logs to `<run dir>/trainer-ranks/rank-<r>.log`.

Stopping: Ctrl-C / SIGTERM reach the launcher, which stops every rank (rank 0 stops its engines and
router first, as a single-rank run does). A launcher killed with SIGKILL takes its ranks with it (each
rank gets SIGKILL when its parent dies), and rank 0 its engines and router. A rank that dies stops the
group: the run fails with `TrainerRankFailed`, naming the rank, its exit code and its last log lines. Rank 0
failing fails the run with its own error, even inside a step whose collectives hold the other ranks: it
sends them nothing more (trainer/ranks.py), exits non-zero once its run has stopped, and the launcher stops
them.

In a trainer pod (`rlfleet run --kubernetes`) the same: the pod's process launches the ranks, rank 0
runs `rlfleet run --kubernetes` (the fleets through the API server); a rank's death that rank 0 did
not report itself fails the pod (the operator replaces the trainer within spec.trainer.maxRestarts).
A trainer group (spec.trainer.nodes > 1) has one launcher per pod: each starts its pod's ranks
(`place`: its node rank and pod 0's address; see orchestrator/run/trainer_group.py) and rank 0, in
pod 0, runs the run.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfleet.crds.models import TrainingRun
from rlfleet.errors import RunError
from rlfleet.orchestrator.run.trainer_setup import build_rank_trainer, device_of, layout_of

if TYPE_CHECKING:
    from rlfleet.orchestrator.run.trainer_group import GroupPlace


def check_before_launch(run: TrainingRun, model_dir: Path) -> None:
    """ValueError naming the field and the numbers when the ranks could not run this model here."""
    from rlfleet.trainer.base import read_hf_config
    from rlfleet.trainer.hf_export import Architecture
    from rlfleet.trainer.parallel import check_layout

    spec = run.spec
    arch = Architecture.from_hf_config(read_hf_config(model_dir))
    available = None
    if device_of(spec) == "cuda":
        import torch

        available = torch.cuda.device_count()
    check_layout(layout_of(spec), spec.trainer.backend, arch, device_of(spec), available,
                 local_ranks=spec.trainer.ranks_per_node)


def launch_run(run: TrainingRun, argv: list[str], model_dir: Path, run_dir: Path,
               on_failure: Callable[[RunError], None] | None = None, place: GroupPlace | None = None) -> int:
    """Launch the run's ranks (this process is their agent); the exit status of the run.

    `on_failure(error)` is called when a rank failed the group and rank 0 did not fail the run itself.
    `place`: this pod's node rank and pod 0's address in a trainer group; None: every rank here.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from rlfleet.trainer.launch import NodePlan, RankFailed, launch_ranks

    world = layout_of(run.spec).world
    group: dict[str, Any] = {} if place is None else dict(nodes=place.nodes, node_rank=place.node_rank,
                                                           rendezvous=place.rendezvous)
    if place is None:
        print(f"rlfleet run: starting {world} trainer ranks; rank logs in {run_dir / 'trainer-ranks'}",
              file=sys.stderr, flush=True)
    else:
        ranks = NodePlan(world, place.nodes, place.node_rank).ranks
        print(f"rlfleet run: node {place.node_rank} of {place.nodes}: starting trainer ranks {ranks.start}-"
              f"{ranks.stop - 1} of {world}, rendezvous on {place.rendezvous[0]}:{place.rendezvous[1]}; rank logs "
              f"in {run_dir / 'trainer-ranks'}", file=sys.stderr, flush=True)
    try:
        launch_ranks(rank_main, (argv, str(model_dir), str(run_dir), run, os.getpid()), world=world,
                     log_dir=run_dir / "trainer-ranks", run_id=run.metadata.name or "rlfleet", tee=True, **group)
    except RankFailed as exc:
        if exc.rank == 0 and exc.exitcode > 0:
            return exc.exitcode  # the run itself failed: rank 0 has said why
        print(f"rlfleet run: FAILED ({exc.reason}): {exc}", file=sys.stderr, flush=True)
        if on_failure is not None:
            on_failure(exc)
        return 1
    except SignalException as exc:
        print(f"rlfleet run: stopped by {exc.sigval.name}; trainer ranks, engines and router stopped", file=sys.stderr)
        return 128 + int(exc.sigval)
    return 0


def rank_main(argv: list[str], model_dir: str, run_dir: str, run: TrainingRun, launcher: int | None = None) -> None:
    """Every rank's entry: rank 0 runs `rlfleet run` itself (same arguments), the others follow it
    (building their part of the trainer from `run`, the spec the launcher checked)."""
    from rlfleet.trainer.ranks import rank_env
    from rlfleet.util.procs import die_with_parent

    if launcher is not None:
        die_with_parent(launcher)

    if rank_env()[0] == 0:
        from rlfleet.orchestrator.run.cli import main

        code = main([*argv, "--run-dir", run_dir])
        if code:
            raise SystemExit(code)
        return
    follow_run(run, Path(model_dir))


def follow_run(run: TrainingRun, model_dir: Path) -> None:
    from rlfleet.trainer.ranks import follow, rank_env

    trainer: Any = build_rank_trainer(run.spec, model_dir)
    rank, world, local = rank_env()
    node = os.environ.get("GROUP_RANK", "0")
    print(f"trainer rank {rank} of {world} (node {node}, local rank {local}): following rank 0", flush=True)
    steps = follow(trainer)
    print(f"trainer rank {rank} of {world} (node {node}, local rank {local}): stopped after step {steps}", flush=True)
