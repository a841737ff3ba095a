"""Weights & Biases, through the W&B client in a process of its own (`wandb_worker`): the training process
never imports wandb, and a W&B call that hangs (a `finish` retrying an unreachable server) is ended by a
bound here, its process group killed.

open: start the process (once) and `wandb.init` there (the flattened spec as config); log: one record as
history rows, the same series names as TensorBoard's, each training series against `step` and each eval
series against `eval/step`; close: `wandb.finish` within `timeout_s` (W&B's own finish timeout, then
SIGKILL to the group).
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORKER_MODULE = "rlfleet.observability.tracking.wandb_worker"
EXIT_GRACE_S = 10.0  # past W&B's own finish timeout, before the process group is killed
LOG_NAME = "rlfleet-wandb.log"  # the W&B client's own output, beside its run files


def available() -> str | None:
    """None when the wandb package can be found (it is imported only in the tracker's own process)."""
    if importlib.util.find_spec("wandb") is None:
        return "the wandb package is not installed; scripts/setup.sh installs it (requirements-tracking.lock)"
    return None


def kill_tree(pid: int) -> None:
    """SIGKILL the W&B process's group and its children: W&B starts its service process (wandb-core) in a
    session of its own (it would go by itself once its parent is gone; this does not wait for that)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            children += [int(c) for c in task.read_text().split()]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for child in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)


class WandbError(Exception):
    pass


@dataclass(frozen=True)
class WandbOptions:
    project: str
    run_name: str
    directory: Path  # W&B's run files (the offline run's .wandb log) go under it
    mode: str = "online"
    entity: str | None = None
    base_url: str | None = None
    timeout_s: float = 30.0


class WandbTracker:
    name = "wandb"

    def __init__(self, options: WandbOptions, *, python: str = sys.executable):
        self.options = options
        self.python = python
        self._proc: asyncio.subprocess.Process | None = None
        self._next_id = 0

    @property
    def log_path(self) -> Path:
        return self.options.directory / LOG_NAME

    async def open(self, params: Mapping[str, str]) -> None:
        if self._proc is None or self._proc.returncode is not None:
            await self._start()
        o = self.options
        await self._ask({"op": "open", "project": o.project, "entity": o.entity, "run_name": o.run_name,
                         "mode": o.mode, "base_url": o.base_url, "timeout_s": o.timeout_s,
                         "dir": str(o.directory), "config": dict(params)})

    async def log(self, step: int, scalars: Mapping[str, float]) -> None:
        await self._ask({"op": "log", "step": step, "scalars": dict(scalars)})

    async def close(self, status: str) -> None:
        """wandb.finish (exit code 0 when FINISHED), bounded; the process group is killed whatever happens."""
        proc = self._proc
        if proc is None:
            return
        bound = self.options.timeout_s + EXIT_GRACE_S
        try:
            if proc.returncode is None:
                try:
                    async with asyncio.timeout(bound):
                        await self._ask({"op": "finish", "exit_code": 0 if status == "FINISHED" else 1})
                        await proc.wait()
                except TimeoutError:
                    raise WandbError(f"wandb.finish did not end within {bound:g} s, its process was killed (what was "
                                     f"not uploaded stays in the .wandb log under {self.options.directory})") from None
        finally:
            await asyncio.shield(asyncio.to_thread(kill_tree, proc.pid))
            with contextlib.suppress(ProcessLookupError):
                await asyncio.shield(proc.wait())
            self._proc = None

    def _open_log(self) -> Any:
        self.options.directory.mkdir(parents=True, exist_ok=True)
        return open(self.log_path, "ab")

    async def _start(self) -> None:
        with await asyncio.to_thread(self._open_log) as log:  # the child keeps its own descriptor
            self._proc = await asyncio.create_subprocess_exec(
                self.python, "-m", WORKER_MODULE, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=log, cwd=str(self.options.directory), start_new_session=True,
                limit=1 << 20)

    async def _ask(self, request: dict[str, Any]) -> None:
        """Send one request and wait for its answer (answers to requests given up on are skipped)."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            raise WandbError(f"the W&B process is not running; see {self.log_path}")
        assert proc.stdin is not None and proc.stdout is not None
        self._next_id += 1
        request_id = self._next_id
        proc.stdin.write((json.dumps({"id": request_id, **request}) + "\n").encode())
        await proc.stdin.drain()
        while True:
            line = await proc.stdout.readline()
            if not line:
                raise WandbError(f"the W&B process ended (exit {await proc.wait()}); see {self.log_path}")
            answer = json.loads(line)
            if answer.get("id") != request_id:
                continue
            if "error" in answer:
                raise WandbError(str(answer["error"]))
            return
