"""Posture fleet: a dedicated eval fleet with its own router, pinned to each point's snapshot.

A point is evaluated only on a fleet that provably serves its snapshot:

1. probe every alive engine (`/health_generate`, concurrently) and mark the unresponsive dead;
2. recreate dead slots and wait until every slot serves (bounded; fewer than minReadyEngines:
   skip `unhealthy`);
3. `update_weights_from_disk {model_path, weight_version: "<step>"}` on every engine at once, then read
   every engine's version back from `/model_info` (pinRetries attempts, each bounded by
   pinTimeoutSeconds). Any engine not reporting the version: skip `pin_violation`. Results from mixed
   versions are never produced;
4. admit pinned engines to the eval router (read-back again there), then a one-token probe through the
   router until it answers from the pinned version (bounded; else skip `unhealthy`);
5. generate and score every dataset through the router; every sample's version is recorded. A point
   during which the eval router was restarted (it exited and was brought back) is skipped `unhealthy`.

Points are pinned one at a time (the fleet serves one version at a time); the dispatcher may export
and queue others meanwhile. A refused load does not kill an engine: it keeps serving its old weights
and is loaded again at the next point. An engine that closes the connection on a load has died and
is marked dead (recreated at the next point).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from rlfleet.crds.eval_specs import EvalSpec
from rlfleet.orchestrator.evaluation.api import EvalOutcome, EvalRequest, EvalSkip
from rlfleet.orchestrator.evaluation.generate import evaluate_datasets
from rlfleet.orchestrator.fleet.backend import DeathCause, EngineSlot, EngineState
from rlfleet.orchestrator.fleet.errors import FleetFailed, FleetNotReady
from rlfleet.orchestrator.fleet.membership import VersionNotPinned
from rlfleet.orchestrator.fleet.runtime import FleetRuntime
from rlfleet.sglang.engine import CacheNotFlushed, gone_for_good, pin_weights
from rlfleet.sglang.errors import CallError
from rlfleet.sglang.http import call, expect_dict
from rlfleet.sglang.router import ONE_TOKEN_PROBE

log = logging.getLogger(__name__)

ROUTER_PROBE = ONE_TOKEN_PROBE
ROUTER_PROBE_INTERVAL_S = 1.0
ROUTER_PROBE_CALL_S = 60.0
PIN_RETRY_DELAY_S = 1.0


class PinnedEvalFleet:
    posture = "fleet"
    uses_snapshots = True
    concurrency = 1

    def __init__(self, runtime: FleetRuntime, spec: EvalSpec, *, wait_alive_timeout_s: float,
                 session: aiohttp.ClientSession | None = None, generate_timeout_s: float = 300.0):
        self.runtime = runtime
        self.spec = spec
        self.wait_alive_timeout_s = wait_alive_timeout_s
        self.generate_timeout_s = generate_timeout_s
        self._session = session
        self._lock = asyncio.Lock()
        self.pins: list[tuple[str, dict[str, str]]] = []  # (version, engine -> version read back), per pin

    @property
    def session(self) -> aiohttp.ClientSession:
        session = self._session or self.runtime.session
        assert session is not None, "eval fleet not started"
        return session

    @property
    def router_url(self) -> str:
        return self.runtime.router_url

    async def evaluate(self, request: EvalRequest) -> EvalOutcome:
        assert request.checkpoint_dir is not None, "posture fleet evaluates snapshots"
        async with self._lock:
            version = request.weight_version
            restarts = self.runtime.router_restarts
            engine_versions = await self.pin(request.checkpoint_dir, version)
            await self.probe_router(version)
            scores = await evaluate_datasets(self.session, self.router_url, request.datasets,
                                             expected_version=version, timeout_s=self.generate_timeout_s,
                                             rid_prefix=f"eval-{request.run}-{request.step}")
            if self.runtime.router_restarts != restarts:
                # Its membership was rebuilt mid-way: the point is not scored on a path that changed under it.
                raise EvalSkip("unhealthy", "the eval router restarted during the point")
        return EvalOutcome(weight_version=version, datasets=scores, engine_versions=engine_versions)

    # --- pinning -------------------------------------------------------------------------------------

    async def pin(self, checkpoint_dir: Path, version: str) -> dict[str, str]:
        """Load the snapshot on every engine; returns slot -> version read back. Raises EvalSkip."""
        backend = self.runtime.backend
        monitor = self.runtime.monitor
        if monitor is not None:
            monitor.pause()  # a loading engine may miss probes; we probe ourselves first
        try:
            await self._probe_and_mark_dead()
            try:
                await backend.recover()
                alive = await backend.wait_all_alive(self.wait_alive_timeout_s)
            except (FleetNotReady, FleetFailed) as exc:
                raise EvalSkip("unhealthy", str(exc)) from exc
            async with asyncio.TaskGroup() as group:
                loads = {e.slot: group.create_task(self._pin_engine(e, str(checkpoint_dir), version)) for e in alive}
            read_back = {str(slot): task.result()[0] or "?" for slot, task in loads.items()}
            self.pins.append((version, dict(read_back)))
            errors = {slot: task.result()[1] for slot, task in loads.items() if task.result()[1]}
            if errors:
                detail = "; ".join(f"slot {slot}: {error}" for slot, error in sorted(errors.items()))
                raise EvalSkip("pin_violation", f"version {version} not pinned on every engine: {detail}",
                               engine_versions=read_back)
            await self._admit(alive, version)
            return read_back
        finally:
            if monitor is not None:
                monitor.resume()

    async def _probe_and_mark_dead(self) -> None:
        backend = self.runtime.backend
        alive = [(e, e.url) for e in backend.engines() if e.state is EngineState.ALIVE and e.url]
        timeout = self.runtime.health_spec.timeout_seconds

        async def probe(engine: EngineSlot, url: str) -> None:
            try:
                await self.runtime.engine_client(url).health_generate(timeout)
            except CallError as exc:
                await backend.mark_dead(engine.slot, f"eval pin probe failed: {exc}", cause=DeathCause.PROBE_FAILED,
                                        incarnation=engine.incarnation)

        await asyncio.gather(*(probe(e, url) for e, url in alive))

    async def _pin_engine(self, engine: EngineSlot, model_path: str, version: str) -> tuple[str | None, str | None]:
        """(version read back, error or None) after at most pinRetries attempts."""
        assert engine.url is not None
        client = self.runtime.engine_client(engine.url)
        timeout = self.spec.pin_timeout_seconds
        served: str | None = None
        error: str | None = None
        for attempt in range(self.spec.pin_retries):
            if attempt:
                await asyncio.sleep(PIN_RETRY_DELAY_S)
            try:
                async with asyncio.timeout(timeout):
                    pinned = await pin_weights(client, model_path, version, load_timeout_s=timeout)
                served = pinned.served
            except TimeoutError:
                error = f"load and read-back took longer than {timeout:g} s"
                continue
            except CacheNotFlushed as exc:
                error = str(exc.last)
                continue
            except CallError as exc:
                error = str(exc)
                if exc.engine_gone and await gone_for_good(client, exc):
                    await self.runtime.backend.mark_dead(engine.slot, f"died loading the eval snapshot: {exc}",
                                                         cause=DeathCause.UNREACHABLE, incarnation=engine.incarnation)
                    break
                continue
            if pinned.serves(version):
                self.runtime.backend.record_weight_version(engine.slot, engine.incarnation, version)
                return version, None
            error = (f"update_weights_from_disk refused: {pinned.load.message}" if not pinned.load.success
                     else f"reports weight version {served!r} after loading {version!r}")
        log.warning("eval fleet slot %d: version %s not pinned: %s", engine.slot, version, error)
        return served, error

    async def _admit(self, alive: list[EngineSlot], version: str) -> None:
        """Register the pinned engines with the eval router. A router that refuses connections (it is
        being restarted) is waited for, within routerProbeTimeoutSeconds."""
        membership = self.runtime.membership
        assert membership is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.spec.router_probe_timeout_seconds
        for engine in alive:
            assert engine.url is not None
            if membership.is_member(engine.url):
                membership.repin(engine.url, version)
                continue
            while True:
                try:
                    await membership.admit(engine.url, version)
                    break
                except CallError as exc:
                    router_down = exc.engine_gone and exc.url.startswith(self.router_url.rstrip("/"))
                    if not router_down or loop.time() + ROUTER_PROBE_INTERVAL_S >= deadline:
                        raise EvalSkip("unhealthy", f"eval router did not take slot {engine.slot}: {exc}") from exc
                    await asyncio.sleep(ROUTER_PROBE_INTERVAL_S)
                except VersionNotPinned as exc:
                    raise EvalSkip("unhealthy", f"eval router did not take slot {engine.slot}: {exc}") from exc

    async def probe_router(self, version: str) -> None:
        """One-token generations through the eval router until one answers from `version` (bounded)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.spec.router_probe_timeout_seconds
        url = self.router_url.rstrip("/") + "/generate"
        last = "no answer yet"
        while True:
            remaining = deadline - loop.time()
            try:
                reply = await call(self.session, "POST", url, json_body=ROUTER_PROBE,
                                   timeout_s=max(0.1, min(ROUTER_PROBE_CALL_S, remaining)))
                served = str((expect_dict(reply, "generate").get("meta_info") or {}).get("weight_version"))
                if served == version:
                    return
                raise EvalSkip("pin_violation", f"the eval router answered from version {served!r}, pinned {version!r}")
            except CallError as exc:
                last = str(exc)
            if loop.time() + ROUTER_PROBE_INTERVAL_S >= deadline:
                raise EvalSkip("unhealthy", f"eval router not serving within "
                                            f"{self.spec.router_probe_timeout_seconds:g} s: {last}")
            await asyncio.sleep(ROUTER_PROBE_INTERVAL_S)

    async def close(self) -> None:
        await self.runtime.stop()


async def start_local_eval_fleet(run_name: str, spec, *, launch_model: Path, run_dir: Path,
                                 python: str | None = None, api_key: str | None = None,
                                 gpu_bases: Sequence[int] = ()) -> tuple[PinnedEvalFleet, object]:
    """Start the eval router and the eval engines as local processes (not waited for: the first pin
    waits). Returns the fleet and the router (stop both: fleet.close(), router.stop())."""
    from rlfleet.crds.derive import eval_fleet_spec
    from rlfleet.orchestrator.fleet.local_backend import LocalBackend
    from rlfleet.orchestrator.fleet.local_router import LocalRouter

    fleet_spec = eval_fleet_spec(run_name, spec)
    if fleet_spec is None:
        raise ValueError("posture fleet needs eval.fleet")
    eval_dir = Path(run_dir) / "eval"
    router_spec = fleet_spec.router
    router = LocalRouter(eval_dir, name="eval-router", health_interval_s=router_spec.health_check_interval_seconds,
                         health_failure_threshold=router_spec.health_failure_threshold, api_key=api_key,
                         policy=router_spec.policy)
    runtime: FleetRuntime | None = None
    try:  # a failure or a cancel anywhere here stops what was started: the router, engines launched
        router_url = await router.start()
        engine = fleet_spec.engine.model_copy(update={"model_path": str(launch_model)})
        backend = LocalBackend(engine=engine, replicas=fleet_spec.replicas, recovery=fleet_spec.recovery,
                               run_dir=eval_dir, fleet="eval", min_ready=fleet_spec.min_ready_engines,
                               weight_version="0", startup_timeout_s=fleet_spec.health.startup_timeout_seconds,
                               python=python, api_key=api_key, gpu_bases=gpu_bases)
        runtime = FleetRuntime(backend, router_url, health=fleet_spec.health, weight_sync=spec.weight_sync,
                               api_key=api_key)
        await runtime.start()
    except BaseException:
        try:
            if runtime is not None:
                await runtime.stop()
        finally:
            await router.stop()
        raise
    fleet = PinnedEvalFleet(runtime, spec.eval, wait_alive_timeout_s=fleet_spec.recovery.wait_all_alive_timeout_seconds)
    return fleet, router
