"""Real SGLang engines and sglang-routers as local processes, for tests, benchmarks and demos.

Each engine gets a loopback address of its own (127.0.0.N) and runs in its own process group with its
output in a log file. Start-up is bounded: readiness is polled with a per-request timeout and a process
that exits early fails at once with the last lines of its log. Teardown stops whole process groups
(SGLang leaves children behind) and removes the /dev/shm load-snapshot files the engine mapped.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from rlfleet.crds.specs import EngineSpec
from rlfleet.orchestrator.fleet.local_router import ROUTER_STOP_GRACE_S
from rlfleet.sglang.launch import build_engine_launch, build_router_args
from rlfleet.util.allocator import find_jemalloc
from rlfleet.util.binaries import python_executable
from rlfleet.util.ports import allocate_endpoint, free_port
from rlfleet.util.procs import (
    GROUP_EXIT_TIMEOUT_S,
    ManagedProcess,
    group_pids,
    list_shm,
    mapped_shm_files,
    orphaned_semaphores,
)

ENGINE_READY_TIMEOUT_S = 300.0  # 25-60 s alone; much longer while other engines compile or load
ROUTER_READY_TIMEOUT_S = 30.0
PROBE_TIMEOUT_S = 10.0


_serial = itertools.count(1)


class StartupFailed(RuntimeError):
    """A process exited or never became ready; the message carries the tail of its log."""


async def wait_until_ready(url: str, process: ManagedProcess, *, timeout_s: float,
                           probe_timeout_s: float = PROBE_TIMEOUT_S, interval_s: float = 0.5) -> float:
    """Poll GET url until it answers 200; return the seconds it took.

    Fails fast (StartupFailed) when the process exits, and after timeout_s otherwise.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    last_error = "no answer yet"
    probe_timeout = aiohttp.ClientTimeout(total=probe_timeout_s)
    exited = asyncio.ensure_future(process.wait())  # wakes the poll up early when the process dies
    try:
        async with aiohttp.ClientSession(timeout=probe_timeout) as session:
            while True:
                if exited.done():
                    raise StartupFailed(_failure_message(
                        process, f"exited with code {process.returncode} before it was ready"))
                try:
                    async with session.get(url) as response:
                        if response.status == 200:
                            return time.monotonic() - started
                        last_error = f"HTTP {response.status}"
                except (aiohttp.ClientError, TimeoutError) as exc:
                    last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                if time.monotonic() >= deadline:
                    raise StartupFailed(_failure_message(
                        process, f"was not ready at {url} after {timeout_s:.0f} s (last probe: {last_error})"))
                await asyncio.wait([exited], timeout=interval_s)
    finally:
        exited.cancel()


def _failure_message(process: ManagedProcess, what: str) -> str:
    tail = "\n".join("    " + line for line in process.tail(30)) or "    (empty log)"
    return f"{process.name} {what}; log {process.log_path}, last lines:\n{tail}"


@dataclass
class EngineProcess:
    """One running SGLang engine process group."""

    name: str
    host: str
    port: int
    model_path: str
    weight_version: str
    process: ManagedProcess
    startup_s: float = 0.0
    shm_files: set[Path] = field(default_factory=set)
    shm_before: frozenset[str] = frozenset()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    def remember_shm_files(self) -> None:
        if self.process.pid is not None:
            self.shm_files |= mapped_shm_files(self.process.pid)

    async def stop(self) -> None:
        self.remember_shm_files()
        pgid = self.process.pid
        await self.process.stop()
        if pgid is not None:
            await wait_group_gone(pgid, GROUP_EXIT_TIMEOUT_S)
        for path in self.shm_files | orphaned_semaphores(since=self.shm_before):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


@dataclass
class RouterProcess:
    """One running sglang-router process."""

    name: str
    host: str
    port: int
    metrics_port: int
    process: ManagedProcess
    startup_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    async def stop(self) -> None:
        await self.process.stop(grace_s=ROUTER_STOP_GRACE_S)


async def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait (bounded) until no live process of the group is left; SIGKILLed children take a moment."""
    deadline = time.monotonic() + timeout_s
    while group_pids(pgid):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def start_engine(model_path: str | os.PathLike, *, log_dir: Path, name: str | None = None,
                       weight_version: str = "0", extra_args: tuple[str, ...] = (),
                       max_total_tokens: int | None = None, api_key: str | None = None,
                       ready_timeout_s: float = ENGINE_READY_TIMEOUT_S,
                       drop_args: tuple[str, ...] = ()) -> EngineProcess:
    """Start one real SGLang CPU engine on its own loopback address and wait until it generates.

    `drop_args`: flags (without values) of the launch builder to leave out, to measure against SGLang's
    default."""
    name = name or f"engine-{next(_serial)}"
    host, port = allocate_endpoint()
    spec = EngineSpec(model_path=str(model_path), device="cpu", port=port,
                      max_total_tokens=max_total_tokens, extra_args=list(extra_args))
    # The allocator and the forked processes `rlfleet run` gives its CPU engines (LocalBackend), so these
    # engines are the same.
    launch = build_engine_launch(spec, host=host, port=port, weight_version=weight_version, api_key=api_key,
                                 malloc_library=find_jemalloc(), forked_cpu_processes=True)
    await asyncio.to_thread(log_dir.mkdir, parents=True, exist_ok=True)
    process = ManagedProcess(
        name, [a for a in launch.argv(python_executable()) if a not in drop_args],
        log_path=log_dir / f"{name}.log", env=launch.env,
        # Not the repository root: `python -m` puts the working directory on sys.path.
        cwd=str(log_dir), die_with_parent=True,
    )
    engine = EngineProcess(name=name, host=host, port=port, model_path=str(model_path),
                         weight_version=weight_version, process=process, shm_before=frozenset(list_shm()))
    await process.start()
    try:
        engine.startup_s = await wait_until_ready(f"{engine.url}/health_generate", process, timeout_s=ready_timeout_s)
        engine.remember_shm_files()
    except BaseException:
        await engine.stop()
        raise
    return engine


async def start_router(*, log_dir: Path, name: str | None = None, health_interval_s: int = 2,
                       health_failure_threshold: int = 2, api_key: str | None = None,
                       ready_timeout_s: float = ROUTER_READY_TIMEOUT_S) -> RouterProcess:
    """Start a real sglang-router with no workers and wait until GET /health answers."""
    name = name or f"router-{next(_serial)}"
    host, port = allocate_endpoint()
    metrics_port = free_port(host)
    args = build_router_args(host=host, port=port, metrics_port=metrics_port, health_interval_s=health_interval_s,
                             health_failure_threshold=health_failure_threshold, api_key=api_key)
    await asyncio.to_thread(log_dir.mkdir, parents=True, exist_ok=True)
    process = ManagedProcess(name, [python_executable(), *args], log_path=log_dir / f"{name}.log",
                             env={"PYTHONUNBUFFERED": "1"}, cwd=str(log_dir), die_with_parent=True)
    router = RouterProcess(name=name, host=host, port=port, metrics_port=metrics_port, process=process)
    await process.start()
    try:
        router.startup_s = await wait_until_ready(f"{router.url}/health", process, timeout_s=ready_timeout_s)
    except BaseException:
        await router.stop()
        raise
    return router


class LocalProcesses:
    """Starts engines and routers and stops every one of them on close, even after failures."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.engines: list[EngineProcess] = []
        self.routers: list[RouterProcess] = []

    async def engine(self, model_path: str | os.PathLike, **kwargs) -> EngineProcess:
        engine = await start_engine(model_path, log_dir=self.log_dir, **kwargs)
        self.engines.append(engine)
        return engine

    async def engines_many(self, model_path: str | os.PathLike, count: int, **kwargs) -> list[EngineProcess]:
        """Start count engines concurrently (all or nothing)."""
        starts = (start_engine(model_path, log_dir=self.log_dir, **kwargs) for _ in range(count))
        results = await asyncio.gather(*starts, return_exceptions=True)
        started = [r for r in results if isinstance(r, EngineProcess)]
        self.engines.extend(started)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise failures[0]
        return started

    async def router(self, **kwargs) -> RouterProcess:
        router = await start_router(log_dir=self.log_dir, **kwargs)
        self.routers.append(router)
        return router

    async def aclose(self) -> None:
        stoppers = [e.stop() for e in self.engines] + [r.stop() for r in self.routers]
        self.engines, self.routers = [], []
        results = await asyncio.gather(*stoppers, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    async def __aenter__(self) -> LocalProcesses:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await asyncio.shield(self.aclose())


def perturbed_copy(src: str | os.PathLike, dst: str | os.PathLike, *, seed: int = 1, scale: float = 0.5) -> Path:
    """Copy a Hugging Face model directory and add seeded Gaussian noise to every floating tensor.

    A stand-in for "the trainer took a step": same names, shapes and dtypes, different weights.
    """
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    for weights in sorted(dst.glob("*.safetensors")):
        tensors = load_file(weights)
        for key, tensor in tensors.items():
            if tensor.is_floating_point():
                noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32).to(tensor.dtype)
                tensors[key] = (tensor + scale * noise).contiguous()
        save_file(tensors, weights, metadata={"format": "pt"})
        weights.chmod(0o644)
    return dst


def on_policy_batch(trainer, prompt: list[int], rewarded: list[tuple[list[int], float]]) -> list:
    """One GRPO group of `prompt` with the given (response, reward) pairs, log-probs from the trainer's
    own current policy (on-policy: ratio 1), assembled as the run loop would."""
    import torch

    from rlfleet.trainer import grpo

    group = []
    for response, reward in rewarded:
        ids = torch.tensor([prompt + response])
        lps = grpo.token_logprobs(trainer.logits(ids), ids)[0, len(prompt) - 1:].tolist()
        group.append(grpo.Sample(tuple(prompt), tuple(response), tuple(lps), str(trainer.step), reward=reward))
    return list(grpo.assemble_batch([group], current_step=trainer.step, policy=grpo.StalenessPolicy(0)).samples)


async def add_workers(session: aiohttp.ClientSession, router_url: str, urls: list[str], timeout_s: float = 60) -> None:
    """Add engines to a router by URL and wait until it lists them all as healthy."""
    timeout = aiohttp.ClientTimeout(total=10)
    for url in urls:
        async with session.post(router_url + "/workers", json={"url": url}, timeout=timeout) as resp:
            assert resp.status == 202, await resp.text()
    deadline = time.monotonic() + timeout_s
    while True:
        async with session.get(router_url + "/workers", timeout=timeout) as resp:
            workers = (await resp.json())["workers"]
        if {w["url"] for w in workers if w["is_healthy"]} >= set(urls):
            return
        assert time.monotonic() < deadline, f"router did not list {urls} as healthy: {workers}"
        await asyncio.sleep(0.2)


async def remove_worker(session: aiohttp.ClientSession, router_url: str, url: str) -> None:
    """Remove an engine from a router by its URL."""
    timeout = aiohttp.ClientTimeout(total=10)
    async with session.get(router_url + "/workers", timeout=timeout) as resp:
        ids = [w["id"] for w in (await resp.json())["workers"] if w["url"].rstrip("/") == url]
    for worker_id in ids:
        async with session.delete(f"{router_url}/workers/{worker_id}", timeout=timeout) as resp:
            assert resp.status == 202, await resp.text()
