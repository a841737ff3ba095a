"""The local fleet backend: each slot is a real SGLang process group on a loopback address of its own.

- The command line comes from `build_engine_launch`, the same builder the operator uses for pods.
- Each incarnation gets a fresh 127.0.0.N address and port (a port in use makes SGLang hang for
  minutes or answer for another engine), and its own log file `slot-<n>/incarnation-<k>.log`.
- The process exit is watched, so a crash is marked dead the moment the process group leader ends,
  without waiting for health probes.
- Teardown is by process group, SIGKILL at once for a dead engine (a SIGSTOPped or port-blocked
  engine ignores SIGTERM), SIGTERM then SIGKILL after a grace period on a normal stop; the
  `/dev/shm` files an engine mapped (load snapshots, semaphores) are removed afterwards.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from rlfleet.crds.specs import EngineSpec, RecoverySpec
from rlfleet.orchestrator.fleet.backend import DeathCause, EngineState, SlotFleetBackend, SlotRecord
from rlfleet.policy.recovery import engine_error_line
from rlfleet.sglang.engine import EngineClient
from rlfleet.sglang.errors import CallError
from rlfleet.sglang.http import client_session
from rlfleet.sglang.launch import build_engine_launch, cpu_threads_per_engine
from rlfleet.util.allocator import find_jemalloc
from rlfleet.util.binaries import python_executable
from rlfleet.util.ports import allocate_endpoint
from rlfleet.util.procs import ManagedProcess, shm_files_of_group, sweep_orphaned_shm

log = logging.getLogger(__name__)

# Shared-memory files an engine leaves behind when its group is killed: SGLang's load snapshots and
# the named semaphores of its multiprocessing children.


class _Incarnation:
    """The process and watcher tasks of one running incarnation."""

    def __init__(self, process: ManagedProcess):
        self.process = process
        self.tasks: list[asyncio.Task] = []
        self.shm_files: set[Path] = set()


def _exit_reason(process: ManagedProcess, code: int | None) -> str:
    error = engine_error_line(process.tail(40))
    return f"process exited with code {code}" + (f": {error}" if error else "")


def _exit_cause(rec: SlotRecord) -> DeathCause:
    return DeathCause.STARTUP_FAILED if rec.state is EngineState.STARTING else DeathCause.EXITED


class LocalBackend(SlotFleetBackend):
    """Real SGLang engine processes, one per slot."""

    def __init__(self, *, engine: EngineSpec, replicas: int, recovery: RecoverySpec, run_dir: str | os.PathLike,
                 fleet: str = "rollout", min_ready: int | None = None, weight_version: str = "0",
                 startup_timeout_s: float = 600.0, ready_poll_s: float = 0.25, ready_probe_timeout_s: float = 10.0,
                 stop_grace_s: float = 8.0, python: str | None = None, api_key: str | None = None,
                 gpu_bases: Sequence[int] = (), exit_attribution_s: float = 2.0):
        super().__init__(fleet=fleet, replicas=replicas, recovery=recovery, min_ready=min_ready)
        self.engine = engine
        self.run_dir = Path(run_dir)
        self.weight_version = weight_version
        self.startup_timeout_s = startup_timeout_s
        self.ready_poll_s = ready_poll_s
        self.ready_probe_timeout_s = ready_probe_timeout_s
        self.stop_grace_s = stop_grace_s
        self.python = python or python_executable()
        self.api_key = api_key  # engines start with --api-key: without the key they answer 401
        # CUDA engines: slot i's first GPU (`--base-gpu-id`), so engines and the trainer share none
        # (rlfleet.orchestrator.run.local_gpus); empty: SGLang's default, GPU 0.
        self.gpu_bases = tuple(gpu_bases)
        if self.gpu_bases and len(self.gpu_bases) < replicas:
            raise ValueError(f"fleet {fleet}: {replicas} engine slots but GPUs planned for {len(self.gpu_bases)}")
        self.malloc_library = find_jemalloc() if engine.device == "cpu" else None
        if engine.device == "cpu" and self.malloc_library is None:
            log.info("fleet %s: no libjemalloc.so.2 on this machine: CPU engines run with glibc's malloc, "
                     "and receive a broadcast weight update ~3x slower", fleet)
        self._session: aiohttp.ClientSession | None = None
        self.exit_attribution_s = exit_attribution_s

    def _client(self, url: str) -> EngineClient:
        if self._session is None or self._session.closed:
            self._session = client_session(self.api_key)
        return EngineClient(self._session, url)

    def log_path(self, slot: int, incarnation: int) -> Path:
        return self.run_dir / "engines" / f"slot-{slot}" / f"incarnation-{incarnation}.log"

    async def start(self) -> None:
        # A run killed with SIGKILL took its engines with it and left their /dev/shm files (16 KiB load
        # files, semaphores) behind; nothing else ever removes them.
        removed = await asyncio.to_thread(sweep_orphaned_shm)
        if removed:
            log.info("fleet %s: removed %d file(s) that killed engines left in /dev/shm", self.fleet, len(removed))
        await super().start()

    # --- SlotFleetBackend hooks ---------------------------------------------------------------------

    async def _launch(self, rec: SlotRecord) -> None:
        host, port = allocate_endpoint()
        launch = build_engine_launch(self.engine, host=host, port=port, weight_version=self.weight_version,
                                     api_key=self.api_key, malloc_library=self.malloc_library,
                                     base_gpu_id=self.gpu_bases[rec.slot] if self.gpu_bases else None,
                                     forked_cpu_processes=True,  # this machine's rlfleet: a faster CPU start
                                     cpu_threads=cpu_threads_per_engine(len(os.sched_getaffinity(0)), self.replicas))
        log_path = self.log_path(rec.slot, rec.incarnation)
        process = ManagedProcess(f"{self.fleet}-slot{rec.slot}-inc{rec.incarnation}", launch.argv(self.python),
                                 log_path=log_path, env=launch.env,
                                 die_with_parent=True)  # a SIGKILLed `rlfleet run` leaves no engine behind
        incarnation = _Incarnation(process)
        rec.handle = incarnation
        rec.url = f"http://{host}:{port}"
        rec.log_path = str(log_path)
        await process.start()
        rec.pid = process.pid
        log.info("fleet %s slot %d incarnation %d: pid %s at %s, log %s", self.fleet, rec.slot, rec.incarnation,
                 rec.pid, rec.url, log_path)
        inc = rec.incarnation
        incarnation.tasks = [
            asyncio.create_task(self._watch_exit(rec, inc, process), name=f"exit-{self.fleet}-{rec.slot}-{inc}"),
            asyncio.create_task(self._watch_ready(rec, inc), name=f"ready-{self.fleet}-{rec.slot}-{inc}"),
        ]

    async def _watch_exit(self, rec: SlotRecord, inc: int, process: ManagedProcess) -> None:
        code = await process.wait()
        if rec.incarnation != inc or rec.state not in (EngineState.STARTING, EngineState.ALIVE):
            return
        rec.exit_code = code
        await self.mark_dead(rec.slot, _exit_reason(process, code), cause=_exit_cause(rec), incarnation=inc)

    async def mark_dead(self, slot: int, reason: str, *, cause: DeathCause = DeathCause.REQUESTED,
                        incarnation: int | None = None) -> bool:
        rec = self._slots.get(slot)
        process = self.process(slot)
        if (cause is DeathCause.UNREACHABLE and rec is not None and process is not None
                and incarnation in (None, rec.incarnation)):
            # A killed engine resets its connections a moment before its exit is seen: a call that found
            # the connection closed waits briefly for the exit, so the death carries its exit code.
            watched = rec.incarnation
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(process.wait()), self.exit_attribution_s)
            if process.returncode is not None:
                if rec.incarnation != watched or rec.state not in (EngineState.STARTING, EngineState.ALIVE):
                    # The exit watcher marked it first: dead as the call found it.
                    return rec.incarnation == watched and rec.state is EngineState.DEAD
                rec.exit_code = process.returncode
                reason = f"{_exit_reason(process, process.returncode)} (a call saw: {reason})"
                cause = _exit_cause(rec)
        return await super().mark_dead(slot, reason, cause=cause, incarnation=incarnation)

    async def _watch_ready(self, rec: SlotRecord, inc: int) -> None:
        """Poll /health_generate until it answers 200 (alive) or the startup bound runs out."""
        assert rec.url is not None
        client = self._client(rec.url)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.startup_timeout_s
        last_error = "no answer yet"
        while rec.incarnation == inc and rec.state is EngineState.STARTING:
            try:
                await client.health_generate(timeout_s=self.ready_probe_timeout_s)
            except CallError as exc:
                last_error = str(exc)
            else:
                incarnation = rec.handle
                if isinstance(incarnation, _Incarnation) and incarnation.process.pid is not None:
                    incarnation.shm_files |= await asyncio.to_thread(shm_files_of_group, incarnation.process.pid)
                self._set_alive(rec.slot, inc)
                return
            if loop.time() >= deadline:
                await self.mark_dead(rec.slot, f"not ready after {self.startup_timeout_s:g} s (last probe: "
                                     f"{last_error})", cause=DeathCause.STARTUP_TIMEOUT, incarnation=inc)
                return
            await asyncio.sleep(self.ready_poll_s)

    async def _terminate(self, rec: SlotRecord, *, graceful: bool) -> None:
        incarnation = rec.handle
        if not isinstance(incarnation, _Incarnation):
            return
        current = asyncio.current_task()
        for task in incarnation.tasks:
            if task is not current and task.get_name().startswith("ready-"):
                task.cancel()
        try:
            code = await asyncio.shield(incarnation.process.stop(grace_s=self.stop_grace_s if graceful else 0.0))
        finally:
            for task in incarnation.tasks:
                if task is not current:
                    task.cancel()
        if rec.exit_code is None and rec.handle is incarnation:
            rec.exit_code = code
        for path in incarnation.shm_files:
            with contextlib.suppress(FileNotFoundError, PermissionError):
                os.unlink(path)

    def _log_tail(self, rec: SlotRecord, lines: int = 30) -> list[str]:
        incarnation = rec.handle
        if isinstance(incarnation, _Incarnation):
            return incarnation.process.tail(lines)
        return []

    # --- extras for tests and tools -------------------------------------------------------------------

    def process(self, slot: int) -> ManagedProcess | None:
        """The process of a slot's current incarnation."""
        incarnation = self._slots[slot].handle
        return incarnation.process if isinstance(incarnation, _Incarnation) else None

    async def stop(self) -> None:
        try:
            await super().stop()
        finally:
            if self._session is not None:
                await self._session.close()
                self._session = None
