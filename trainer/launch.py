"""Start a trainer's ranks on this machine with torch.distributed's elastic launcher (torchrun semantics).

`launch_ranks(entry, args, world=N, log_dir=...)` runs `entry(*args)` in N processes, one per rank,
after a c10d rendezvous on loopback, with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT). No restarts: when any rank exits non-zero the launcher stops the others
(SIGTERM, then SIGKILL) and `launch_ranks` raises `RankFailed` naming the rank that failed (see
`culprit`), its exit code and its last log lines. Every rank's output goes to `<log_dir>/rank-<r>.log` (stdout and
stderr); with `tee`, rank 0's is also shown on the terminal. A SIGINT or SIGTERM of the launching
process is passed to every rank (SIGKILL after SHUTDOWN_TIMEOUT_S), then raises the launcher's
SignalException (its `sigval` is the signal).
"""
from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlfleet.errors import RunError
from rlfleet.util.ports import free_port
from rlfleet.util.procs import tail_file

LOG_TAIL_LINES = 30
# How long a stopping rank may take (rank 0 of a run stops its engines and router within 20 s) before
# the launcher kills it.
SHUTDOWN_TIMEOUT_S = 30


class RankFailed(RunError):
    """A trainer rank exited non-zero (or was killed); the group was stopped."""

    def __init__(self, rank: int, exitcode: int, log_tail: str, log_path: Path | None):
        self.rank, self.exitcode, self.log_tail, self.log_path = rank, exitcode, log_tail, log_path
        where = f" ({log_path})" if log_path else ""
        how = f"was killed by {_signal_name(-exitcode)}" if exitcode < 0 else f"exited with {exitcode}"
        super().__init__(f"trainer rank {rank} {how}; its last log lines{where}:\n{log_tail}",
                         reason="TrainerRankFailed")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def launch_ranks(entry: Callable[..., Any], args: tuple[Any, ...], *, world: int, log_dir: Path,
                 run_id: str = "rlfleet-trainer", tee: bool = False) -> dict[int, Any]:
    """Run entry(*args) in `world` local ranks; the return value of every rank, by rank."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=run_id,
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port('127.0.0.1')}", local_addr="127.0.0.1",
        max_restarts=0, monitor_interval=0.5, start_method="spawn", shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir / "elastic"), redirects=Std.ALL,
                                    tee=Std.ALL if tee else Std.NONE, local_ranks_filter={0} if tee else None),
    )
    # As torchrun does: ranks sharing a machine do not each take all of its cores.
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads is None and world > 1:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
    try:
        results = elastic_launch(config, entry)(*args)
    except ChildFailedError as exc:
        rank, failure = culprit(exc.failures)
        _collect_logs(log_dir, world)
        path = log_dir / f"rank-{rank}.log"
        tail = "\n".join(tail_file(path, LOG_TAIL_LINES) + _traceback_tail(failure))
        raise RankFailed(rank, failure.exitcode, tail, path if path.exists() else None) from None
    finally:
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    _collect_logs(log_dir, world)
    return dict(results)


def culprit(failures: dict[int, Any]) -> tuple[int, Any]:
    """The rank to blame: the first other rank that failed, else rank 0.

    Rank 0 runs the run: alone, its failure is the run's own (it says why). When another rank dies,
    rank 0 usually fails too (a collective with a dead peer), in the same instant.
    """
    others = {r: f for r, f in failures.items() if r != 0}
    pool = others or failures
    rank = min(pool, key=lambda r: (pool[r].timestamp, r))
    return rank, pool[rank]


def _traceback_tail(failure: Any) -> list[str]:
    """The last lines of the failed rank's traceback (the launcher records it beside the logs)."""
    data = getattr(failure, "error_file_data", None) or {}
    message = data.get("message") if isinstance(data, dict) else None
    stack = message.get("extraInfo", {}).get("py_callstack") if isinstance(message, dict) else None
    if isinstance(stack, str) and stack:
        return [line for line in stack.splitlines() if line.strip()][-LOG_TAIL_LINES:]
    return [str(failure.message)] if failure.message else []


def _collect_logs(log_dir: Path, world: int) -> None:
    """rank-<r>.log beside the elastic agent's nested files: that rank's stdout, then its stderr."""
    attempts = sorted((log_dir / "elastic").glob("*/attempt_*"), key=os.path.getmtime)
    if not attempts:
        return
    attempt = attempts[-1]
    for rank in range(world):
        parts = [attempt / str(rank) / name for name in ("stdout.log", "stderr.log")]
        text = "".join(p.read_text(errors="replace") for p in parts if p.exists())
        (log_dir / f"rank-{rank}.log").write_text(text)
