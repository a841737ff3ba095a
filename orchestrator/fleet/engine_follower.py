"""Router membership of a fleet of no run: its router routes to the fleet's Ready engine pods.

A run's trainer registers the engines that serve its weights (`membership.RouterMembership`). A fleet of
no run has no trainer, so a small process beside its router (`rlfleet follow-engines`, a second container
of the router pod) keeps the router listing exactly the fleet's engine pods that may serve:

- controlled by the fleet (its UID is their controller ownerReference: a pod that only carries the
  engine labels is never routed to, nor sent the fleet's key),
- Running and Ready (the readiness probe passed), not being deleted, with an IP.

It watches the pods (list + watch, relisting after errors) and reconciles on every change and every
`interval_s` (a router container that restarted forgot its workers): `GET /workers`, then `POST
/workers` for each missing URL and `DELETE /workers/{id}` for each one listed but not desired, so an
engine that failed, was deleted, or whose IP a new pod took is dropped within one change or interval.
(sglang-router's own Kubernetes discovery drops a pod only when it is deleted while still Ready: a
crashed engine, Failed before its deletion, stays listed forever, and its URL is reused by the next pod
given that IP.)
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from rlfleet.crds.conventions import engine_selector
from rlfleet.kube.client import PODS, ApiError, KubeClient, list_and_watch
from rlfleet.kube.ownership import controller_uid
from rlfleet.kube.pods import view_pod
from rlfleet.orchestrator.fleet.membership import plan_membership
from rlfleet.sglang.errors import CallError
from rlfleet.sglang.router import RouterClient

log = logging.getLogger(__name__)

PROBLEM_LOG_EVERY_S = 30.0  # the same failure (router not up yet, API server away) is logged this often
STALE_AFTER_INTERVALS = 3  # not ready when no reconcile succeeded in this many intervals (and 15 s)


def follower_ready(last_success: float | None, now: float, *, interval_s: float,
                   problem: str | None) -> tuple[bool, str]:
    """Pure: whether the follower keeps its router up to date (its container's readiness), and why not.
    A follower that cannot read the pods (no account, a Role without pods) or reach its router makes its
    pod unready, where `kubectl get pods` shows it, instead of a router silently routing to nothing."""
    stale_after = max(STALE_AFTER_INTERVALS * interval_s, 15.0)
    if last_success is not None and now - last_success <= stale_after:
        return True, "the router's workers are the fleet's Ready engines"
    since = "never" if last_success is None else f"not for {now - last_success:.0f} s"
    return False, f"the router's workers were reconciled {since}: {problem or 'no pod list yet'}"


def routable_engine_urls(pods: Iterable[dict], *, fleet_uid: str, port: int) -> list[str]:
    """Pure: the URLs the router should list: pods the fleet controls that are Running and Ready, not
    being deleted, with an IP."""
    urls = []
    for pod in pods:
        if controller_uid(pod) != fleet_uid:
            continue
        view = view_pod(pod)
        if view.ready and not view.terminating and view.pod_ip:
            urls.append(f"http://{view.pod_ip}:{port}")
    return sorted(urls)


@dataclass(frozen=True)
class FollowedFleet:
    namespace: str
    name: str
    uid: str
    engine_port: int


class EngineFollower:
    """Keeps one router's workers equal to its fleet's routable engine pods."""

    def __init__(self, kube: KubeClient, router: RouterClient, fleet: FollowedFleet, *, interval_s: float = 5.0):
        self.kube = kube
        self.router = router
        self.fleet = fleet
        self.interval_s = interval_s
        self._pods: dict[str, dict] = {}  # pod UID -> pod, as last seen
        self._changed = asyncio.Event()
        self._last_problem: tuple[str, float] | None = None
        self._listed = False  # a first pod list arrived: until then an empty router is not yet known right
        self.last_success: float | None = None  # the loop's clock
        self.problem: str | None = None

    def ready(self) -> tuple[bool, str]:
        return follower_ready(self.last_success, asyncio.get_running_loop().time(), interval_s=self.interval_s,
                              problem=self.problem)

    async def run(self) -> None:
        """Watch and reconcile until cancelled."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(list_and_watch(self.kube, PODS, self._on_list, self._on_event,
                                             namespace=self.fleet.namespace,
                                             label_selector=engine_selector(self.fleet.name),
                                             on_error=lambda e: self._problem(f"watching the engine pods: {e}")))
            tasks.create_task(self._reconcile_loop())

    async def _on_list(self, items: list[dict]) -> None:
        self._pods = {p["metadata"]["uid"]: p for p in items}
        self._listed = True
        self._changed.set()

    async def _on_event(self, kind: str, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        if kind == "DELETED":
            self._pods.pop(uid, None)
        else:
            self._pods[uid] = pod
        self._changed.set()

    async def _reconcile_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                async with asyncio.timeout(self.interval_s):
                    await self._changed.wait()
            except TimeoutError:
                pass
            self._changed.clear()
            started = loop.time()
            if not self._listed:
                continue  # the watch reports why (on_error)
            try:
                await self.reconcile()
            except (CallError, ApiError, OSError) as e:
                self._problem(f"reconciling the router's workers: {e}")
            # Bursts of pod events (a rollout) coalesce into one reconcile per second at most.
            await asyncio.sleep(max(0.0, 1.0 - (loop.time() - started)))

    async def reconcile(self) -> tuple[list[str], list[str]]:
        """One pass: (added URLs, removed URLs)."""
        desired = routable_engine_urls(self._pods.values(), fleet_uid=self.fleet.uid, port=self.fleet.engine_port)
        plan = plan_membership(await self.router.list_workers(), desired)
        for url in plan.add:
            await self.router.add_worker(url)
            log.info("router %s: added engine %s", self.router.base_url, url)
        for worker in plan.remove:
            await self.router.remove_worker(worker.id)
            log.info("router %s: removed %s (no Ready engine pod of fleet %s/%s has it)", self.router.base_url,
                     worker.url, self.fleet.namespace, self.fleet.name)
        self._last_problem, self.problem = None, None
        self.last_success = asyncio.get_running_loop().time()
        return list(plan.add), [w.url for w in plan.remove]

    def _problem(self, message: str) -> None:
        self.problem = message
        now = asyncio.get_running_loop().time()
        last = self._last_problem
        if last is None or last[0] != message or now - last[1] >= PROBLEM_LOG_EVERY_S:
            log.warning("%s (retrying)", message)
            self._last_problem = (message, now)
