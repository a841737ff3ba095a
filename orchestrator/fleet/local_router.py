"""An sglang-router process for local runs: started with no workers (membership is the
orchestrator's job), on a loopback address of its own, stopped by process group.

`RouterSupervisor` watches it like the engines are watched: a router that exits is restarted at
once on the same address (a later attempt, after a failed start, on a new one that the fleet's
clients follow), the pinned engines are registered again, within the router spec's restart budget
and with the fleet's recovery backoff (rlfleet.policy.recovery). A router that cannot be brought
back fails the run with its own last log lines.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from rlfleet.crds.specs import RecoverySpec
from rlfleet.observability import metrics
from rlfleet.orchestrator.fleet.errors import ROUTER_FAILED_REASON, RouterFailed
from rlfleet.policy.recovery import RouterGiveUp, plan_router_restart
from rlfleet.sglang.errors import CallError
from rlfleet.sglang.http import call, client_session
from rlfleet.sglang.launch import build_router_args
from rlfleet.util.binaries import python_executable
from rlfleet.util.ports import allocate_endpoint, free_port
from rlfleet.util.procs import ManagedProcess

log = logging.getLogger(__name__)

# sglang-router 0.3.2 takes 5-8 s to exit after SIGTERM even idle (0 workers, nothing in flight), and it
# holds no state of ours (membership is re-registered on every start): a stop waits 1 s, then kills it.
ROUTER_STOP_GRACE_S = 1.0

__all__ = ["ROUTER_FAILED_REASON", "LocalRouter", "RouterFailed", "RouterStartFailed", "RouterSupervisor"]

LOG_LINES = 12


class RouterStartFailed(RuntimeError):
    pass


class LocalRouter:
    def __init__(self, run_dir: str | os.PathLike, *, name: str = "router", health_interval_s: int = 2,
                 health_failure_threshold: int = 2, python: str | None = None, api_key: str | None = None,
                 policy: str | None = None):
        self.run_dir = Path(run_dir)
        self.name = name
        self.health_interval_s = health_interval_s
        self.health_failure_threshold = health_failure_threshold
        self.python = python or python_executable()
        self.api_key = api_key  # the router requires it on /generate and /workers
        self.policy = policy  # spec.*.router.policy; None: the router's default
        self.process: ManagedProcess | None = None
        self.url: str | None = None
        self.stopping = False
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.run_dir / f"{self.name}.log"

    def tail(self, lines: int = LOG_LINES) -> list[str]:
        return self.process.tail(lines) if self.process is not None else []

    async def start(self, timeout_s: float = 60.0, *, address: tuple[str, int] | None = None) -> str:
        """Start the router (on `address`, or a fresh loopback address) and wait until it answers."""
        host, port = address or allocate_endpoint()
        metrics_port = free_port(host)
        args = build_router_args(host=host, port=port, metrics_port=metrics_port,
                                 health_interval_s=self.health_interval_s,
                                 health_failure_threshold=self.health_failure_threshold, api_key=self.api_key,
                                 policy=self.policy)
        self.process = ManagedProcess(self.name, [self.python, *args], log_path=self.log_path, die_with_parent=True)
        self.starts += 1
        await self.process.start()
        self.url = f"http://{host}:{port}"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        last = "no answer yet"
        async with client_session(self.api_key) as session:
            while True:
                if self.process.returncode is not None:
                    raise RouterStartFailed(f"router exited with code {self.process.returncode}; last log lines:\n"
                                            + "\n".join(self.process.tail(20)))
                try:
                    await call(session, "GET", self.url + "/health", timeout_s=2.0)
                    return self.url
                except CallError as exc:
                    last = str(exc)
                if loop.time() >= deadline:
                    await self.process.stop(grace_s=2.0)
                    raise RouterStartFailed(f"router not answering at {self.url} after {timeout_s:g} s: {last}")
                await asyncio.sleep(0.2)

    def address(self) -> tuple[str, int] | None:
        if self.url is None:
            return None
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    async def restart(self, *, same_address: bool = True, timeout_s: float = 60.0) -> str:
        """Start it again (after an exit): on its old address, or a new one."""
        if self.process is not None:
            await self.process.stop(grace_s=0.0)  # reap what is left of the old group
        return await self.start(timeout_s, address=self.address() if same_address else None)

    async def wait_exit(self) -> int:
        assert self.process is not None, "router not started"
        return await self.process.wait()

    async def stop(self) -> None:
        self.stopping = True
        if self.process is not None:
            await self.process.stop(grace_s=ROUTER_STOP_GRACE_S)


# Called with the router's URL after each restart (the same or a new one): re-register the engines.
OnRestart = Callable[[str], Awaitable[None]]


class RouterSupervisor:
    """Keeps one fleet's local router running; `run()` raises RouterFailed when it cannot."""

    def __init__(self, router: LocalRouter, *, fleet: str, max_restarts: int, recovery: RecoverySpec,
                 on_restart: OnRestart, on_event: Callable[[str], None] | None = None,
                 start_timeout_s: float = 60.0):
        self.router = router
        self.fleet = fleet
        self.max_restarts = max_restarts
        self.recovery = recovery
        self._on_restart = on_restart
        self._on_event = on_event or (lambda message: None)
        self.start_timeout_s = start_timeout_s
        self.restarts = 0  # restart attempts (each one spends budget)
        self.restored = 0  # restarts that brought the router back
        self.history: list[str] = []  # one line per exit and restart, for the summary
        metrics.ROUTER_RESTART_BUDGET.labels(fleet=fleet).set(max_restarts)
        metrics.ROUTER_RESTARTS.labels(fleet=fleet)
        metrics.ROUTER_UP.labels(fleet=fleet).set(1)

    def _event(self, message: str) -> None:
        self.history.append(message)
        log.warning("fleet %s: %s", self.fleet, message)
        self._on_event(message)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            code = await self.router.wait_exit()
            if self.router.stopping:
                return
            metrics.ROUTER_UP.labels(fleet=self.fleet).set(0)
            exited_at = loop.time()
            tail = self.router.tail()
            self._event(f"router {self.router.url} exited with code {code}")
            same_address = True
            failures: list[str] = []
            while True:
                decision = plan_router_restart(self.restarts, max_restarts=self.max_restarts, spec=self.recovery)
                if isinstance(decision, RouterGiveUp):
                    raise RouterFailed(self._give_up_message(code, decision.why, failures, tail), log_tail=tail)
                if decision.delay_s:
                    await asyncio.sleep(decision.delay_s)
                if self.router.stopping:
                    return
                self.restarts += 1
                try:
                    url = await self.router.restart(same_address=same_address, timeout_s=self.start_timeout_s)
                except RouterStartFailed as exc:
                    failures.append(str(exc).splitlines()[0])
                    tail = self.router.tail() or tail
                    self._event(f"router restart {decision.attempt} failed: {failures[-1]}")
                    same_address = False  # e.g. its port was taken meanwhile: take a new address
                    continue
                break
            self.restored += 1
            metrics.ROUTER_RESTARTS.labels(fleet=self.fleet).inc()
            metrics.ROUTER_UP.labels(fleet=self.fleet).set(1)
            self._event(f"router restarted at {url} ({loop.time() - exited_at:.1f} s after the exit; restart "
                        f"{self.restarts} of {self.max_restarts})")
            await self._on_restart(url)

    def _give_up_message(self, code: int, why: str, failures: list[str], tail: list[str]) -> str:
        parts = [f"fleet {self.fleet}: the router exited (code {code}) and cannot be brought back: {why}"]
        parts += [f"restart failed: {f}" for f in failures]
        parts.append(f"router last log lines ({self.router.log_path}):")
        parts += ["    " + line for line in (tail or ["(empty log)"])]
        return "\n".join(parts)
