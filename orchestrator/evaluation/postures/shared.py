"""Posture shared: evaluate on the rollout engines themselves, at the version they serve.

The point holds the weight-sync lock for its whole length, so no weight update can interleave; it
pauses the fully-async producer without aborting anything (groups in flight finish and are kept),
reads the version back from every rollout engine (they must agree), generates through the rollout
router, reads the versions again (still the same, or the point is skipped), and resumes the producer.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import aiohttp

from rlfleet.orchestrator.evaluation.api import EvalOutcome, EvalRequest, EvalSkip
from rlfleet.orchestrator.evaluation.generate import evaluate_datasets
from rlfleet.orchestrator.fleet.backend import EngineState
from rlfleet.orchestrator.fleet.runtime import FleetRuntime
from rlfleet.sglang.errors import CallError

log = logging.getLogger(__name__)


class PausableProducer(Protocol):
    async def pause(self) -> None: ...

    def resume(self) -> None: ...


class SharedEvaluator:
    posture = "shared"
    uses_snapshots = False
    concurrency = 1  # one set of engines, one version at a time

    def __init__(self, fleet: FleetRuntime, producer: PausableProducer, session: aiohttp.ClientSession, *,
                 pause_timeout_s: float = 600.0, generate_timeout_s: float = 300.0):
        self.fleet = fleet
        self.producer = producer
        self.session = session
        self.pause_timeout_s = pause_timeout_s
        self.generate_timeout_s = generate_timeout_s
        self.pauses: list[tuple[float, float]] = []  # (paused at, resumed at), loop time

    async def _versions(self) -> dict[str, str]:
        engines = [(e.slot, e.url) for e in self.fleet.backend.engines() if e.state is EngineState.ALIVE and e.url]
        if not engines:
            raise EvalSkip("unhealthy", "no rollout engine is alive")
        try:
            async with asyncio.TaskGroup() as group:
                reads = {str(slot): group.create_task(self.fleet.engine_client(url).weight_version())
                         for slot, url in engines}
        except* CallError as failed:
            raise EvalSkip("unhealthy", f"version read-back failed: {failed.exceptions[0]}") from None
        return {slot: task.result() for slot, task in reads.items()}

    async def evaluate(self, request: EvalRequest) -> EvalOutcome:
        assert self.fleet.weights is not None, "fleet not started"
        loop = asyncio.get_running_loop()
        async with self.fleet.weights.lock:
            paused_at = loop.time()
            try:
                try:
                    async with asyncio.timeout(self.pause_timeout_s):
                        await self.producer.pause()
                except TimeoutError:
                    raise EvalSkip("unhealthy", f"rollout groups in flight did not finish within "
                                                f"{self.pause_timeout_s:g} s") from None
                before = await self._versions()
                served = set(before.values())
                if len(served) != 1:
                    raise EvalSkip("pin_violation", f"rollout engines serve different versions: {before}")
                version = served.pop()
                scores = await evaluate_datasets(self.session, self.fleet.router_url, request.datasets,
                                                 expected_version=version, timeout_s=self.generate_timeout_s,
                                                 rid_prefix=f"eval-{request.run}-{request.step}")
                after = await self._versions()
                if set(after.values()) != {version}:
                    raise EvalSkip("pin_violation", f"versions changed during the eval: {before} -> {after}")
            finally:
                self.producer.resume()
                self.pauses.append((paused_at, loop.time()))
        return EvalOutcome(weight_version=version, datasets=scores, engine_versions=before)

    async def close(self) -> None:
        return None
