"""Start a trainer's ranks on this machine with torch.distributed's elastic launcher (torchrun semantics).

`launch_ranks(entry, args, world=N, log_dir=...)` runs `entry(*args)` in N processes, one per rank,
after a c10d rendezvous on loopback, with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT). No restarts: when any rank exits non-zero the launcher stops the others
(SIGTERM, then SIGKILL) and `launch_ranks` raises `RankFailed` naming the rank that failed (see
`culprit`), its exit code and its last log lines. Every rank's output goes to `<log_dir>/rank-<r>.log` (stdout and
stderr); with `tee`, rank 0's is also shown on the terminal. A SIGINT or SIGTERM of the launching
process is passed to every rank (SIGKILL after SHUTDOWN_TIMEOUT_S), then raises the launcher's
SignalException (its `sigval` is the signal).

Across nodes (a trainer group: one launcher per pod) `launch_ranks(..., world=W, nodes=N, node_rank=i,
rendezvous=(pod 0's address, port))` starts this node's W/N ranks; the launchers meet in a static
rendezvous on node 0 (torchrun's `--node-rank` semantics: node ranks are given, not drawn), so the global
rank of local rank l on node i is i * W/N + l and rank 0 always lives on node 0. Node 0's TCP store
listens on exactly that address (pods that share a host's network, as the dev cluster's, must not take
each other's port on every address); every rank's process group uses it too (torch's agent store).
"""
from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class NodePlan:
    """This launcher's share of a group of `nodes` launchers: which ranks it starts."""

    world: int
    nodes: int = 1
    node_rank: int = 0

    def __post_init__(self) -> None:
        if self.world < 1 or self.nodes < 1:
            raise ValueError(f"world and nodes must be >= 1, got world {self.world}, nodes {self.nodes}")
        if self.world % self.nodes:
            raise ValueError(f"a world of {self.world} ranks does not split evenly over {self.nodes} nodes")
        if not 0 <= self.node_rank < self.nodes:
            raise ValueError(f"node rank {self.node_rank} is outside a group of {self.nodes} nodes")

    @property
    def local(self) -> int:
        """Ranks on this node."""
        return self.world // self.nodes

    def global_rank(self, local_rank: int) -> int:
        """torchrun's rank of this node's `local_rank`: node_rank x ranks per node + local rank."""
        return self.node_rank * self.local + local_rank

    @property
    def ranks(self) -> range:
        """The global ranks this node runs."""
        return range(self.global_rank(0), self.global_rank(self.local))


def launch_ranks(entry: Callable[..., Any], args: tuple[Any, ...], *, world: int, log_dir: Path,
                 run_id: str = "rlfleet-trainer", tee: bool = False, nodes: int = 1, node_rank: int = 0,
                 rendezvous: tuple[str, int] | None = None, rendezvous_timeout_s: int = 600) -> dict[int, Any]:
    """Run entry(*args) in this node's ranks of a `world`; the return value of each of them, by global rank.

    One node (the default): all `world` ranks here, meeting on a free loopback port. Several: this is
    node `node_rank` of `nodes`, meeting the others on `rendezvous` (node 0's address and port) within
    `rendezvous_timeout_s`."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    plan = NodePlan(world, nodes, node_rank)
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    if nodes == 1:
        rdzv: dict[str, Any] = dict(rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port('127.0.0.1')}",
                                    local_addr="127.0.0.1")
    else:
        if rendezvous is None:
            raise ValueError("a launcher of several nodes needs the rendezvous address of node 0")
        _register_static_rendezvous()
        host, port = rendezvous
        rdzv = dict(rdzv_backend=STATIC_RENDEZVOUS, rdzv_endpoint=f"{host}:{port}",
                    rdzv_configs={"rank": node_rank, "timeout": rendezvous_timeout_s})
    config = LaunchConfig(
        min_nodes=nodes, max_nodes=nodes, nproc_per_node=plan.local, run_id=run_id, **rdzv,
        max_restarts=0, monitor_interval=0.5, start_method="spawn", shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir / "elastic"), redirects=Std.ALL,
                                    tee=Std.ALL if tee else Std.NONE, local_ranks_filter={0} if tee else None),
    )
    # As torchrun does: ranks sharing a machine do not each take all of its cores.
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads is None and plan.local > 1:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // plan.local))
    try:
        results = elastic_launch(config, entry)(*args)
    except ChildFailedError as exc:
        rank, failure = culprit(exc.failures)
        _collect_logs(log_dir, plan)
        path = log_dir / f"rank-{rank}.log"
        tail = "\n".join(tail_file(path, LOG_TAIL_LINES) + _traceback_tail(failure))
        raise RankFailed(rank, failure.exitcode, tail, path if path.exists() else None) from None
    finally:
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    _collect_logs(log_dir, plan)
    return dict(results)


STATIC_RENDEZVOUS = "rlfleet-static"


def _register_static_rendezvous() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(STATIC_RENDEZVOUS, _static_rendezvous)  # again: a no-op


def _static_rendezvous(params: Any) -> Any:
    """torch's static rendezvous, node 0's store listening on the rendezvous address only (torch's own
    listens on every address of the machine)."""
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous, create_rdzv_handler

    class OnOneAddress(StaticTCPRendezvous):
        def get_backend(self) -> str:
            return STATIC_RENDEZVOUS

    handler = create_rdzv_handler(params)
    assert isinstance(handler, StaticTCPRendezvous)
    handler.__class__ = OnOneAddress
    if handler.rank == 0:
        handler._store = _store_on(handler.master_addr, handler.master_port, handler.world_size, handler.timeout)
    return handler


def _store_on(address: str, port: int, nodes: int, timeout: Any) -> Any:
    """The group's TCP store server, on a socket bound to exactly address:port."""
    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(128)
        return TCPStore(address, port, nodes, True, timeout, wait_for_workers=False, multi_tenant=True,
                        master_listen_fd=sock.detach(), use_libuv=True)
    except BaseException:
        sock.close()
        raise


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


def _collect_logs(log_dir: Path, plan: NodePlan) -> None:
    """rank-<r>.log (r: the global rank) beside the elastic agent's nested files (by local rank): that
    rank's stdout, then its stderr."""
    attempts = sorted((log_dir / "elastic").glob("*/attempt_*"), key=os.path.getmtime)
    if not attempts:
        return
    attempt = attempts[-1]
    for local in range(plan.local):
        parts = [attempt / str(local) / name for name in ("stdout.log", "stderr.log")]
        text = "".join(p.read_text(errors="replace") for p in parts if p.exists())
        (log_dir / f"rank-{plan.global_rank(local)}.log").write_text(text)
