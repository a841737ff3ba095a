"""Fixtures over real parts: the tiny model, SGLang CPU engines, sglang-routers, a local control plane.

Expensive things are session-scoped and shared: one engine (`shared_engine`) serves many tests, one
control plane (`control_plane`) serves every e2e test. Integration and e2e tests run in one
session-wide event loop, so async session fixtures (engines, routers) can be awaited from any test.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import pytest
import pytest_asyncio

from helpers.engines import EngineProcess, LocalProcesses, RouterProcess
from rlfleet.util.binaries import CACHE_DIR

if TYPE_CHECKING:
    from rlfleet.devcluster.control_plane import ControlPlane

TESTS_DIR = Path(__file__).parent
SESSION_LOOP_DIRS = (TESTS_DIR / "integration", TESTS_DIR / "e2e")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Engines and routers live in the session loop: tests that talk to them must run in it too.
    session_loop = pytest.mark.asyncio(loop_scope="session")
    for item in items:
        if pytest_asyncio.is_async_test(item) and any(Path(item.path).is_relative_to(d) for d in SESSION_LOOP_DIRS):
            item.add_marker(session_loop, append=False)


def worker_group(nodeid: str) -> str:
    """Which tests share a worker under `pytest -n N --dist loadgroup` (make test): every cluster test
    (one control plane per session), otherwise a module's tests (its module-scoped engines start once)."""
    module = nodeid.split("::", 1)[0]
    return "cluster" if module.startswith("tests/e2e/") else module


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    # pytest-xdist's own loadgroup reads `xdist_group` marks through a node id pytest 9 no longer keeps;
    # the same scheduling (whole groups per worker, handed out as workers free up) over worker_group.
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkerGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return ByWorkerGroup(config, log)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny Llama model (seed 0), generated offline once and cached. Treat it as read-only."""
    from rlfleet.trainer.tiny import ensure_tiny_model

    return ensure_tiny_model(CACHE_DIR / "models" / "tiny-llama-seed0", seed=0)


@pytest.fixture(scope="session")
def process_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where engine and router logs of this session go (kept by pytest for the last runs)."""
    return tmp_path_factory.mktemp("process-logs")


class EngineFactory:
    """`await sglang_engines.start()` / `.start_many(n)`: real engines on their own 127.0.0.N."""

    def __init__(self, processes: LocalProcesses, default_model: Path):
        self._processes = processes
        self._default_model = default_model

    async def start(self, model_path: Path | str | None = None, **kwargs) -> EngineProcess:
        return await self._processes.engine(model_path or self._default_model, **kwargs)

    async def start_many(self, count: int, model_path: Path | str | None = None, **kwargs) -> list[EngineProcess]:
        return await self._processes.engines_many(model_path or self._default_model, count, **kwargs)


class RouterFactory:
    """`await sglang_router.start()`: a real sglang-router with no workers."""

    def __init__(self, processes: LocalProcesses):
        self._processes = processes

    async def start(self, **kwargs) -> RouterProcess:
        return await self._processes.router(**kwargs)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def shared_processes(process_logs: Path) -> AsyncIterator[LocalProcesses]:
    async with LocalProcesses(process_logs / "shared") as processes:
        yield processes


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def shared_engine(shared_processes: LocalProcesses, tiny_model: Path) -> EngineProcess:
    """One engine serving the tiny model at weight version "0", shared by the whole session.

    A test that loads other weights into it must load the tiny model back (version "0") before it ends.
    A test that kills or SIGSTOPs an engine must start its own with `sglang_engines`; one that pauses
    it through its API (/pause_generation) must continue it before it ends.
    """
    return await shared_processes.engine(tiny_model, name="shared-engine", weight_version="0")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def lent_shared_engine(shared_engine: EngineProcess, tiny_model: Path) -> AsyncIterator[EngineProcess]:
    """The shared engine (tiny model, float32 on CPU), lent to a module that loads other weights into it:
    the tiny model is loaded back as version "0" when the module ends. Saves an engine start per module."""
    yield shared_engine
    from rlfleet.sglang.engine import EngineClient

    async with aiohttp.ClientSession() as session:
        result = await EngineClient(session, shared_engine.url).update_weights_from_disk(str(tiny_model), "0")
    assert result.success, f"the shared engine did not load the tiny model back: {result.message}"


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def session_sglang_engines(shared_processes: LocalProcesses, tiny_model: Path) -> EngineFactory:
    """Factory of engines that live until the end of the session (share them across a module's tests).

    `await engine.stop()` ends one early; whatever is left is stopped when the session ends.
    """
    return EngineFactory(shared_processes, tiny_model)


@pytest_asyncio.fixture(loop_scope="session")
async def sglang_engines(process_logs: Path, tiny_model: Path,
                         request: pytest.FixtureRequest) -> AsyncIterator[EngineFactory]:
    """Factory of engines owned by one test: every engine it started is stopped when the test ends.

    Keep at most two engines alive at a time (each takes ~2.2 GB and 25-60 s to start).
    """
    async with LocalProcesses(process_logs / _safe_name(request.node.name)) as processes:
        yield EngineFactory(processes, tiny_model)


@pytest_asyncio.fixture(loop_scope="session")
async def sglang_router(process_logs: Path, request: pytest.FixtureRequest) -> AsyncIterator[RouterFactory]:
    """Factory of routers owned by one test (a router starts in about a second)."""
    async with LocalProcesses(process_logs / _safe_name(request.node.name)) as processes:
        yield RouterFactory(processes)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A real etcd + kube-apiserver (RBAC) + kube-controller-manager on loopback, for the session.

    `control_plane.kubectl(...)`, `.kubeconfig` (admin), `.service_account_kubeconfig(ns, name)`.
    """
    from rlfleet.devcluster.control_plane import ControlPlane

    plane = ControlPlane(tmp_path_factory.mktemp("control-plane"))
    try:
        plane.start()
        yield plane
    finally:
        plane.stop()


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:80]
