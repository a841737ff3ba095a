"""FleetRuntime: one fleet's backend, health monitor, router membership and weight sync, wired.

- The monitor probes the backend's alive engines and marks the dead through the backend; a refused
  connection (nothing listens: the process is gone) is a death at once.
- Every death (probe, process exit, failed load) reaches the membership at once, which removes the
  engine from the router, and the monitor, which stops probing that incarnation. So does every engine
  of a slot scaled away (a resize of a Kubernetes fleet); a slot added is admitted by the first sync
  after it is Ready.
- Weight syncs pause the monitor, recover, load, read back and admit replacements.
- The heat guard (optional, orchestrator/guards/heat_guard.py `heat_guard_for`) pauses hot engines;
  the monitor holds their probes meanwhile.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp

from rlfleet.crds.specs import HealthSpec, WeightSyncSpec
from rlfleet.observability import metrics
from rlfleet.orchestrator.fleet.backend import (
    ENGINE_STATES,
    DeathCause,
    DeathEvent,
    EngineState,
    FleetBackend,
    FleetResize,
)
from rlfleet.orchestrator.fleet.membership import RouterMembership
from rlfleet.orchestrator.fleet.monitor import HealthMonitor, ProbeTarget
from rlfleet.orchestrator.fleet.weight_sync import WeightSync, WeightSyncResult
from rlfleet.sglang.engine import EngineClient, EngineTimeouts
from rlfleet.sglang.errors import CallError
from rlfleet.sglang.http import client_session, fleet_connector
from rlfleet.sglang.launch import ServedWeights
from rlfleet.sglang.router import RouterClient, normalize_url
from rlfleet.snapshot.format import SnapshotReference

log = logging.getLogger(__name__)


class FleetRuntime:
    def __init__(self, backend: FleetBackend, router_url: str, *, health: HealthSpec, weight_sync: WeightSyncSpec,
                 reference: SnapshotReference | str | Path | None = None,
                 timeouts: EngineTimeouts | None = None, api_key: str | None = None,
                 broadcast_address: str = "127.0.0.1", broadcast_device: str = "cpu",
                 served: ServedWeights = ServedWeights(), broadcast_port: int | None = None):
        self.backend = backend
        self.api_key = api_key  # the fleet's key: every call to its engines and router sends it
        self.fleet = backend.fleet
        self.health_spec = health
        self.router_url = router_url
        self.timeouts = timeouts or EngineTimeouts(health=health.timeout_seconds)
        self._reference = reference
        self._weight_sync_spec = weight_sync
        self._broadcast_address = broadcast_address
        self._broadcast_port = broadcast_port
        self._broadcast_device = broadcast_device
        self._served = served
        self.session: aiohttp.ClientSession | None = None
        self.monitor: HealthMonitor | None = None
        self.membership: RouterMembership | None = None
        self.weights: WeightSync | None = None
        self.router: RouterClient | None = None
        self.router_restarts = 0  # restarts (or replacements) of the fleet's router seen so far
        self._unsubscribe: list[Callable[[], None]] = []

    def engine_client(self, url: str) -> EngineClient:
        assert self.session is not None, "FleetRuntime not started"
        return EngineClient(self.session, url, self.timeouts)

    def _probe_targets(self) -> list[ProbeTarget]:
        return [ProbeTarget(e.slot, e.incarnation, e.url) for e in self.backend.engines()
                if e.state is EngineState.ALIVE and e.url]

    async def _on_probe_dead(self, target: ProbeTarget, reason: str) -> None:
        await self.backend.mark_dead(target.slot, reason, cause=DeathCause.PROBE_FAILED,
                                     incarnation=target.incarnation)

    async def _on_death(self, event: DeathEvent) -> None:
        assert self.monitor is not None and self.membership is not None
        self.monitor.forget(event.slot, event.incarnation)
        await self.membership.on_death(event)

    async def _on_resize(self, event: FleetResize) -> None:
        assert self.monitor is not None and self.membership is not None
        for engine in event.retired:
            self.monitor.forget(engine.slot, engine.incarnation)
            metrics.forget_engine_slot(self.fleet, engine.slot, ENGINE_STATES)
            if engine.url:
                await self.membership.evict(engine.url, reason=f"slot {engine.slot} scaled away "
                                            f"({event.replicas_before} -> {event.replicas} engines)")

    def _alive_urls(self) -> list[str]:
        return [e.url for e in self.backend.engines() if e.state is EngineState.ALIVE and e.url]

    async def start(self) -> None:
        """Create the clients and loops; launch the engines (not yet in the router)."""
        # No connection cap: a thousand engines are probed in the same round.
        self.session = client_session(self.api_key, connector=fleet_connector())
        self.router = RouterClient(self.session, self.router_url)
        self.membership = RouterMembership(self.router, engine_client=self.engine_client,
                                           alive_urls=self._alive_urls, fleet=self.fleet,
                                           interval_s=self.health_spec.interval_seconds)
        # Probes go through the monitor's own keep-alive client (GET /health_generate), not the session.
        self.monitor = HealthMonitor(self.health_spec, targets=self._probe_targets, on_dead=self._on_probe_dead,
                                     fleet=self.fleet)
        if isinstance(self._reference, (str, Path)):
            # Without a manifest this reads every safetensors header of the served model: off the loop.
            self._reference = await asyncio.to_thread(SnapshotReference.from_dir, self._reference)
        self.weights = WeightSync(self.backend, self.membership, spec=self._weight_sync_spec,
                                  engine_client=self.engine_client, monitor=self.monitor,
                                  reference=self._reference,
                                  broadcast_address=self._broadcast_address, broadcast_port=self._broadcast_port,
                                  broadcast_device=self._broadcast_device,
                                  served=self._served)
        self._unsubscribe = [self.backend.subscribe(self._on_death), self.backend.subscribe_resize(self._on_resize)]
        await self.backend.start()
        await self.monitor.start()
        await self.membership.start()

    def move_router(self, url: str) -> None:
        """The fleet's router now answers at `url` (its pod was replaced): the membership's reconcile
        registers every pinned engine there within one interval, and rollouts follow at once."""
        self.router_url = url
        if self.router is not None:
            self.router.base_url = normalize_url(url)

    async def router_restarted(self, url: str) -> None:
        """The fleet's router was restarted (at `url`, maybe a new address) and knows no worker:
        follow it and register every pinned engine there again."""
        self.router_restarts += 1
        if url != self.router_url:
            self.move_router(url)
        if self.membership is not None:
            await self.membership.reregister()

    async def serves_through_router(self, *, within_s: float, call_timeout_s: float = 30.0,
                                    retry_s: float = 1.0) -> str | None:
        """One-token generations through the router until one answers (bounded by `within_s`).
        None when one did; else the last error."""
        assert self.router is not None, "FleetRuntime not started"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        last = "no answer"
        while True:
            remaining = deadline - loop.time()
            try:
                await self.router.probe(timeout_s=max(0.1, min(call_timeout_s, remaining)))
                return None
            except CallError as exc:
                last = str(exc)
            if loop.time() + retry_s >= deadline:
                return last
            await asyncio.sleep(retry_s)

    async def bring_up(self, version: str, timeout: float | None = None) -> list[int]:  # noqa: ASYNC109 - see wait_all_alive
        """Wait for the engines to serve their launch weights, admit them to the router and, in broadcast
        mode, build their update group (see WeightSync.open_group)."""
        assert self.membership is not None
        alive = await self.backend.wait_all_alive(timeout)
        admitted = []
        for engine in alive:
            if engine.url and not self.membership.is_member(engine.url):
                await self.membership.admit(engine.url, version)
                self.backend.record_weight_version(engine.slot, engine.incarnation, version)
                admitted.append(engine.slot)
        if self.weights is not None:
            await self.weights.open_group()
        return admitted

    def export_views(self) -> dict[str, Any] | None:
        """Where the trainer may export the next step's weights for the broadcast (see WeightSync)."""
        return self.weights.export_views() if self.weights is not None else None

    async def sync_weights(self, snapshot_dir: str | Path, step: int, *, tensors: Mapping[str, Any] | None = None,
                           write_snapshot: Callable[[], Awaitable[Any]] | None = None) -> WeightSyncResult:
        """Sync the snapshot's weights; in broadcast mode `tensors` (the same weights) are broadcast, and
        `write_snapshot`, when given, writes the snapshot after the broadcast (see WeightSync.sync)."""
        assert self.weights is not None
        return await self.weights.sync(snapshot_dir, step, tensors=tensors, write_snapshot=write_snapshot)

    async def stop(self) -> None:
        try:
            if self.weights is not None:
                await self.weights.close()
            if self.monitor is not None:
                await self.monitor.stop()
            if self.membership is not None:
                await self.membership.stop()
            for unsubscribe in self._unsubscribe:
                unsubscribe()
        finally:
            try:
                await self.backend.stop()
            finally:
                if self.session is not None:
                    await self.session.close()
