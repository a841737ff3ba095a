"""Router membership: who may receive rollout traffic.

Rules:
- An engine joins the router only once its weights are pinned: `admit` reads the version back from
  the engine's `/model_info` and registers it only when it matches.
- A dead engine leaves the router the moment it is marked dead (`evict`, wired to the backend's
  death events), not when the router's own health checks notice.
- A reconcile loop compares `GET /workers` with the engines believed alive and pinned, every probe
  interval, and removes anything else (and re-adds members a restarted router forgot), so the router
  never holds a URL believed dead for longer than one interval.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rlfleet.observability import metrics
from rlfleet.orchestrator.fleet.backend import DeathEvent
from rlfleet.sglang.engine import EngineClient
from rlfleet.sglang.errors import CallError
from rlfleet.sglang.router import RouterClient, RouterWorker, normalize_url
from rlfleet.util.aio import stop_task

log = logging.getLogger(__name__)


RECONCILE_WARN_EVERY_S = 30.0


class VersionNotPinned(RuntimeError):
    """An engine reported another weight version than the one it must serve."""


@dataclass(frozen=True)
class MembershipPlan:
    add: tuple[str, ...]  # URLs to register
    remove: tuple[RouterWorker, ...]  # registered workers to remove


def plan_membership(listed: Iterable[RouterWorker], desired: Iterable[str]) -> MembershipPlan:
    """Pure: what to change so that the router lists exactly the desired URLs."""
    desired_set = {normalize_url(u) for u in desired}
    listed = list(listed)
    listed_urls = {w.url for w in listed}
    return MembershipPlan(
        add=tuple(sorted(desired_set - listed_urls)),
        remove=tuple(w for w in listed if w.url not in desired_set),
    )


@dataclass(frozen=True)
class MembershipChange:
    change: str  # "add" | "remove"
    url: str
    at: float  # the event loop's clock
    version: str | None = None
    reason: str = ""


class RouterMembership:
    """Keeps one router's worker list equal to the fleet's alive, pinned engines."""

    def __init__(self, router: RouterClient, *, engine_client: Callable[[str], EngineClient],
                 alive_urls: Callable[[], Iterable[str]], fleet: str = "rollout", interval_s: float = 5.0,
                 registration_timeout_s: float = 30.0):
        self.router = router
        self.fleet = fleet
        self.interval_s = interval_s
        self.registration_timeout_s = registration_timeout_s
        self._engine_client = engine_client
        self._alive_urls = alive_urls
        self._pinned: dict[str, str] = {}  # url -> version read back
        self._ids: dict[str, str] = {}  # url -> router worker id
        self._added_at: dict[str, float] = {}  # url -> when its registration was queued
        self._reconcile_lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self.history: list[MembershipChange] = []

    def pinned(self) -> dict[str, str]:
        return dict(self._pinned)

    def _record(self, change: str, url: str, version: str | None = None, reason: str = "") -> None:
        self.history.append(MembershipChange(change, url, asyncio.get_running_loop().time(), version, reason))
        metrics.ROUTER_MEMBERSHIP_CHANGES.labels(fleet=self.fleet, change=change).inc()

    async def admit(self, url: str, expected_version: str, *, wait_listed: bool = True) -> str:
        """Read the engine's version back; register it with the router only if it is expected_version."""
        url = normalize_url(url)
        version = await self._engine_client(url).weight_version()
        if version != expected_version:
            raise VersionNotPinned(f"{url} serves weight version {version!r}, expected {expected_version!r}; "
                                   "not added to the router")
        self._pinned[url] = version
        worker_id = await self.router.add_worker(url)
        newly = url not in self._ids
        self._ids[url] = worker_id
        self._added_at[url] = asyncio.get_running_loop().time()
        if newly:
            self._record("add", url, version)
            log.info("fleet %s: router add %s (version %s read back)", self.fleet, url, version)
        if wait_listed:
            await self.router.wait_listed(url, timeout_s=self.registration_timeout_s)
        return worker_id

    def repin(self, url: str, version: str) -> None:
        """A member's version was read back again after a sync."""
        url = normalize_url(url)
        if url in self._pinned:
            self._pinned[url] = version

    def is_member(self, url: str) -> bool:
        return normalize_url(url) in self._ids

    async def evict(self, url: str, reason: str = "") -> bool:
        """Remove url from the router now (it is dead or unpinned). True if the router held it."""
        url = normalize_url(url)
        self._pinned.pop(url, None)
        worker_id = self._ids.pop(url, None)
        self._added_at.pop(url, None)
        try:
            if worker_id is None:
                worker_id = (await self.router.worker_ids_by_url()).get(url)
            removed = worker_id is not None and await self.router.remove_worker(worker_id)
        except CallError as exc:
            # The reconcile loop retries within one interval.
            log.warning("fleet %s: router removal of %s failed (%s); reconcile will retry", self.fleet, url, exc)
            return False
        if removed:
            self._record("remove", url, reason=reason)
            log.info("fleet %s: router remove %s (%s)", self.fleet, url, reason)
        return removed

    async def on_death(self, event: DeathEvent) -> None:
        """Backend death listener."""
        if event.url:
            await self.evict(event.url, reason=f"{event.cause.value}: {event.reason}")

    async def reconcile(self) -> MembershipPlan:
        """One pass: make the router list exactly the alive, pinned engines."""
        async with self._reconcile_lock:
            alive = {normalize_url(u) for u in self._alive_urls()}
            for url in list(self._pinned):
                if url not in alive:
                    self._pinned.pop(url, None)
            listed = await self.router.list_workers()
            metrics.ROUTER_WORKERS.labels(fleet=self.fleet).set(len(listed))
            plan = plan_membership(listed, self._pinned)
            for worker in plan.remove:
                self._ids.pop(worker.url, None)
                self._added_at.pop(worker.url, None)
                with contextlib.suppress(CallError):
                    if await self.router.remove_worker(worker.id):
                        self._record("remove", worker.url, reason="reconcile: not an alive pinned engine")
            now = asyncio.get_running_loop().time()
            for url in plan.add:
                version = self._pinned.get(url)
                registering = now - self._added_at.get(url, float("-inf")) < self.registration_timeout_s
                if version is None or registering:
                    continue  # evicted meanwhile, or its registration is still in progress
                with contextlib.suppress(CallError, VersionNotPinned):
                    await self.admit(url, version, wait_listed=False)
            return plan

    async def reregister(self) -> int:
        """The router was restarted and knows no worker: register every pinned engine again now (not
        waiting for the reconcile loop, nor for registrations in progress). Returns how many were sent."""
        sent = 0
        async with self._reconcile_lock:
            for url, version in list(self._pinned.items()):
                try:
                    await self.admit(url, version, wait_listed=False)
                    sent += 1
                except (CallError, VersionNotPinned) as exc:
                    log.warning("fleet %s: re-registering %s with the restarted router: %s", self.fleet, url, exc)
        log.info("fleet %s: %d pinned engine(s) registered with the restarted router", self.fleet, sent)
        return sent

    # --- background loop ----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"membership-{self.fleet}")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        failing_since: float | None = None
        last_warned = float("-inf")
        while True:
            try:
                await self.reconcile()
                if failing_since is not None:
                    log.warning("fleet %s: router reconcile works again after %.0f s", self.fleet,
                                loop.time() - failing_since)
                failing_since = None
            except CallError as exc:
                now = loop.time()
                failing_since = now if failing_since is None else failing_since
                if now - last_warned >= RECONCILE_WARN_EVERY_S:  # one line per half minute, not per interval
                    last_warned = now
                    log.warning("fleet %s: router reconcile failing for %.0f s: %s", self.fleet,
                                now - failing_since, exc)
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            await stop_task(self._task)
            self._task = None
