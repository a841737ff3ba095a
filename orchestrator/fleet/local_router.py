"""An sglang-router process for local runs: started with no workers (membership is the
orchestrator's job), on a loopback address of its own, stopped by process group."""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import aiohttp

from rlfleet.sglang.errors import CallError
from rlfleet.sglang.http import call
from rlfleet.sglang.launch import build_router_args
from rlfleet.util.binaries import python_executable
from rlfleet.util.ports import allocate_endpoint, free_port
from rlfleet.util.procs import ManagedProcess


class RouterStartFailed(RuntimeError):
    pass


class LocalRouter:
    def __init__(self, run_dir: str | os.PathLike, *, name: str = "router", health_interval_s: int = 2,
                 health_failure_threshold: int = 2, python: str | None = None):
        self.run_dir = Path(run_dir)
        self.name = name
        self.health_interval_s = health_interval_s
        self.health_failure_threshold = health_failure_threshold
        self.python = python or python_executable()
        self.process: ManagedProcess | None = None
        self.url: str | None = None
        self.metrics_url: str | None = None

    async def start(self, timeout_s: float = 60.0) -> str:
        host, port = allocate_endpoint()
        metrics_port = free_port(host)
        args = build_router_args(host=host, port=port, metrics_port=metrics_port,
                                 health_interval_s=self.health_interval_s,
                                 health_failure_threshold=self.health_failure_threshold)
        self.process = ManagedProcess(self.name, [self.python, *args], log_path=self.run_dir / f"{self.name}.log",
                                      die_with_parent=True)
        await self.process.start()
        self.url = f"http://{host}:{port}"
        self.metrics_url = f"http://{host}:{metrics_port}/metrics"
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        async with aiohttp.ClientSession() as session:
            while True:
                if self.process.returncode is not None:
                    raise RouterStartFailed(f"router exited with code {self.process.returncode}; last log lines:\n"
                                            + "\n".join(self.process.tail(20)))
                try:
                    await call(session, "GET", self.url + "/health", timeout_s=2.0)
                    return self.url
                except CallError as exc:
                    last = str(exc)
                if time.monotonic() >= deadline:
                    await self.stop()
                    raise RouterStartFailed(f"router not answering at {self.url} after {timeout_s:g} s: {last}")
                await asyncio.sleep(0.2)

    async def stop(self) -> None:
        if self.process is not None:
            await self.process.stop(grace_s=5.0)
