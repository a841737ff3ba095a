"""The Kubernetes fleet backend: the orchestrator's view of a RolloutFleet/EvalFleet run by the operator.

Same interface as the local backend (`FleetBackend`); the difference is who acts:

- the engines are the fleet's pods `<fleet>-engine-<slot>`, created and recreated by the operator,
  within the fleet's restart budget and backoff (this backend never creates or deletes a pod);
- `mark_dead` marks the slot's pod dead (the cause and the reason) in the fleet's
  `status.orchestrator.engines` (`rlfleet.kube.marks`: the trainer's ServiceAccount may patch no pod and
  no spec, only the status of its fleets and run); the slot is dead for the orchestrator at once, and
  the operator recreates it;
- the backend watches the fleet's pods, so a terminated container is marked dead (and listeners hear
  of it) the moment the node reports it, without waiting for health probes;
- an incarnation is one pod: its number is the pod's `rlfleet.io/restarts` annotation + 1;
- `wait_all_alive` waits until every slot that is not given up has a Ready pod (its readiness probe
  passed), bounded; the weight sync then pins the current weights on it;
- the number of slots and minReadyEngines follow the fleet's spec (a run's follows the run's
  spec.rollout, which may change while it runs): a slot added is starting until its first pod is Ready
  and gets the current weights at the first sync after that (no sync waits for it, unless
  minReadyEngines needs it); a slot scaled away leaves at once (`FleetResize` to the listeners: out of
  the router, no longer probed), and its pod's end is no death;
- the fleet's `Failed` condition (set by the operator on a crash loop) becomes `FleetFailed` with the
  operator's message, which quotes the engine's last log lines;
- `record_weight_version` also writes the version into the slot's mark, so the fleet status shows every
  engine's version;
- a pod is the fleet's only when the fleet's UID is its controller ownerReference: one that merely
  carries the engine labels (or squats a slot's name) is ignored, as is a router-labelled pod that no
  ReplicaSet of the fleet's router Deployment owns.

`stop()` stops watching; the engines belong to the fleet (scale it to zero, or delete the run).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from rlfleet.crds import conventions
from rlfleet.crds.fleet_specs import FleetSpec
from rlfleet.crds.specs import RecoverySpec
from rlfleet.kube.client import (
    DEPLOYMENTS,
    PODS,
    REPLICASETS,
    ApiError,
    KubeClient,
    list_and_watch,
    rlfleet_resource,
)
from rlfleet.kube.conditions import find
from rlfleet.kube.marks import engine_mark_patch, engine_marks, mark_of, pin_patch, run_failure_patch
from rlfleet.kube.ownership import owned_by, owned_router_pods
from rlfleet.kube.pods import int_or, pod_failure, view_pod
from rlfleet.observability import metrics
from rlfleet.orchestrator.fleet.backend import (
    ENGINE_STATES,
    DeathCause,
    DeathEvent,
    DeathListener,
    EngineSlot,
    EngineState,
    FleetBackend,
    FleetResize,
    Listeners,
    ResizeListener,
    death_listeners,
    export_restart_budget,
    fleet_not_ready,
)
from rlfleet.orchestrator.fleet.errors import FleetFailed, FleetNotReady
from rlfleet.policy.recovery import exponential_backoff
from rlfleet.util.aio import stop_task
from rlfleet.util.redact import redact

log = logging.getLogger(__name__)

WATCH_READY_TIMEOUT_S = 30.0
MARK_RETRY_BASE_S = 1.0  # a dead mark the API server did not take: written again after 1, 2, 4 ... 30 s
MARK_RETRY_MAX_S = 30.0


def slot_view(slot: int, pod: dict | None, entry: dict | None, *, port: int, marked_dead: int | None,
              weight_version: str | None, mark: dict | None = None, had_pod: bool = True) -> EngineSlot:
    """One slot as the orchestrator sees it, from its pod, the operator's status entry and the
    orchestrator's mark of the pod (`mark`); `had_pod`: whether a pod of the slot was ever seen. Pure."""
    entry = entry or {}
    failure = (entry.get("lastFailure") or {})
    last_failure = f"{failure.get('reason')}: {failure.get('message', '')}".strip() if failure else None
    if pod is None:
        restarts = int(entry.get("restarts") or 0)
        if entry.get("state") == "Failed":
            state = EngineState.FAILED
        elif not had_pod and restarts == 0 and entry.get("state") in (None, "New", "Pending"):
            state = EngineState.STARTING  # its first pod is not created yet (the fleet's start, a scale-up)
        else:
            state = EngineState.DEAD
        return EngineSlot(slot=slot, url=None, state=state, incarnation=restarts, restarts=restarts,
                          last_failure=last_failure, exit_code=failure.get("exitCode"))
    view = view_pod(pod, mark)
    incarnation = view.restarts + 1
    if entry.get("state") == "Failed":
        state = EngineState.FAILED
    elif marked_dead == incarnation or view.terminating or view.failure is not None:
        state = EngineState.DEAD
    elif view.ready:
        state = EngineState.ALIVE
    else:
        state = EngineState.STARTING
    url = f"http://{view.pod_ip}:{port}" if view.pod_ip else None
    exit_code = view.failure.exit_code if view.failure else failure.get("exitCode")
    return EngineSlot(slot=slot, url=url, state=state, incarnation=incarnation, restarts=view.restarts,
                      weight_version=weight_version or view.weight_version, last_failure=last_failure,
                      exit_code=exit_code, pod=view.name)


def all_settled(engines: list[EngineSlot], min_ready: int, *, not_waited_for: set[int]) -> bool:
    """Whether a wait for the fleet's engines is over: every slot serves or is given up, but for the
    slots in `not_waited_for` (added by a scale-up, never served) once `min_ready` serve. Pure."""
    settled = (EngineState.ALIVE, EngineState.FAILED)
    if all(e.state in settled for e in engines):
        return True
    alive = sum(1 for e in engines if e.state is EngineState.ALIVE)
    return alive >= min_ready and all(e.state in settled or e.slot in not_waited_for for e in engines)


def recreated_since(engine: EngineSlot, loaded_incarnation: int | None) -> bool:
    """A slot the operator is recreating, or recreated after `loaded_incarnation` was handed out. Pure.

    A first pod still starting (no restart yet, nothing handed out) is the fleet's start, not a recovery.
    """
    if engine.state is EngineState.DEAD:
        return True
    if engine.state in (EngineState.STARTING, EngineState.ALIVE):
        if loaded_incarnation is None:
            return engine.restarts > 0
        return engine.incarnation != loaded_incarnation
    return False


def fleet_failure(fleet_name: str, status: dict | None) -> FleetFailed | None:
    """The operator's Failed condition as the orchestrator's FleetFailed (None while not failed)."""
    cond = find((status or {}).get("conditions"), "Failed")
    if not cond or cond.get("status") != "True":
        return None
    failed = [e for e in (status or {}).get("engines", []) if e.get("state") == "Failed"]
    last = (failed[-1].get("lastFailure") or {}) if failed else {}
    message = cond.get("message", "")
    return FleetFailed(f"fleet {fleet_name}: {message}", reason=cond.get("reason", "EngineCrashLoop"),
                       slot=failed[-1]["slot"] if failed else None, exit_code=last.get("exitCode"),
                       log_tail=(last.get("message") or "").splitlines()[-30:])


class KubernetesBackend(FleetBackend):
    """A fleet whose engines are pods managed by the rlfleet operator."""

    def __init__(self, kube: KubeClient, *, namespace: str, fleet: str, fleet_uid: str, replicas: int,
                 min_ready: int, recovery: RecoverySpec, port: int = 30000, kind: str = "RolloutFleet"):
        self.kube = kube
        self.namespace = namespace
        self.fleet = fleet
        self.fleet_uid = fleet_uid  # the engine pods' controller: pods not owned by it are not the fleet's
        self.kind = kind
        self.replicas = replicas
        self.min_ready = min_ready
        self.recovery = recovery
        self.port = port
        self._fleet_res = rlfleet_resource(kind)
        self._pods: dict[int, dict] = {}
        self._status: dict = {}
        self._marked: dict[int, int] = {}  # slot -> incarnation marked dead here
        self._reported: set[tuple[int, int]] = set()  # (slot, incarnation) deaths already emitted
        self._seen_ready: set[tuple[int, int]] = set()
        self._versions: dict[tuple[int, int], str] = {}
        self._loaded: dict[int, int] = {}  # slot -> incarnation a wait_all_alive handed out (weights loaded next)
        self._marks: dict[int, dict] = {}  # slot -> the whole mark last set here (written to the fleet status)
        self._retired_uids: set[str] = set()  # pods of slots scaled away
        self._had_pod: set[int] = set()  # slots where a pod was seen (since the slot was added)
        self._added: set[int] = set()  # slots a scale-up added that have not served yet
        self._exported: dict[int, tuple[EngineState, int]] = {}  # slot -> (state, restarts) in the metrics
        self._mark_lock = asyncio.Lock()  # one mark write at a time, each sending the latest marks
        self._deaths = death_listeners()
        self._resizes: Listeners[FleetResize] = Listeners("resize")
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self._mark_retries: set[asyncio.Task] = set()  # dead marks the API server has not taken yet
        self._changed = asyncio.Event()
        self._pods_listed = asyncio.Event()
        self._fleet_listed = asyncio.Event()
        # The operator spends the budget; the restart alerts compare the slots' restarts with it.
        export_restart_budget(fleet, recovery)

    @classmethod
    async def connect(cls, kube: KubeClient, *, namespace: str, fleet: str, kind: str = "RolloutFleet"
                      ) -> KubernetesBackend:
        """A backend for an existing fleet, its settings read from the fleet object."""
        obj = await kube.get(rlfleet_resource(kind), fleet, namespace)
        spec = FleetSpec.model_validate(obj["spec"])
        return cls(kube, namespace=namespace, fleet=fleet, fleet_uid=obj["metadata"]["uid"], kind=kind,
                   replicas=spec.replicas,
                   min_ready=spec.min_ready_engines, recovery=spec.recovery, port=spec.engine.port)

    # Watches ---------------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._tasks:
            return
        self._tasks = [
            asyncio.create_task(list_and_watch(self.kube, PODS, self._on_pods_listed, self._on_pod_event,
                                               namespace=self.namespace,
                                               label_selector=conventions.engine_selector(self.fleet),
                                               on_error=lambda e: log.warning("engine pod watch: %s", e))),
            asyncio.create_task(list_and_watch(self.kube, self._fleet_res, self._on_fleets_listed,
                                               self._on_fleet_event, namespace=self.namespace,
                                               field_selector=f"metadata.name={self.fleet}",
                                               on_error=lambda e: log.warning("fleet watch: %s", e))),
        ]
        try:
            async with asyncio.timeout(WATCH_READY_TIMEOUT_S):
                await self._pods_listed.wait()
                await self._fleet_listed.wait()
        except TimeoutError:
            await self.stop()
            raise FleetNotReady(
                f"fleet {self.fleet}: could not list its pods within {WATCH_READY_TIMEOUT_S:g} s") from None

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._deaths.drain()
        await self._resizes.drain()
        await asyncio.gather(*self._background, return_exceptions=True)
        for task in list(self._mark_retries):
            await stop_task(task)

    def _slot_of(self, pod: dict) -> int | None:
        if not owned_by(pod, self.fleet_uid):
            return None  # labelled as one of the fleet's engines, but not the operator's pod
        if pod["metadata"].get("uid") in self._retired_uids:
            return None  # its slot was scaled away
        view = view_pod(pod)
        if view.slot is None or view.name != conventions.engine_pod_name(self.fleet, view.slot):
            return None
        return view.slot

    async def _on_pods_listed(self, pods: list[dict]) -> None:
        self._pods = {}
        for pod in pods:
            if (slot := self._slot_of(pod)) is not None:
                self._pods[slot] = pod
                self._observe(slot, pod)
        self._pods_listed.set()
        self._notify()

    async def _on_pod_event(self, kind: str, pod: dict) -> None:
        slot = self._slot_of(pod)
        if slot is None:
            return
        current = self._pods.get(slot)
        if kind == "DELETED":
            if current and current["metadata"]["uid"] == pod["metadata"]["uid"]:
                del self._pods[slot]
                self._observe(slot, None, deleted=pod)
        else:
            self._pods[slot] = pod
            self._observe(slot, pod)
        self._notify()

    async def _on_fleets_listed(self, fleets: list[dict]) -> None:
        if fleets:
            self._status = fleets[0].get("status") or {}
            self._follow_spec(fleets[0].get("spec") or {})
        self._fleet_listed.set()
        self._notify()

    async def _on_fleet_event(self, kind: str, fleet: dict) -> None:
        if kind != "DELETED":
            self._status = fleet.get("status") or {}
            self._follow_spec(fleet.get("spec") or {})
        self._notify()

    def _follow_spec(self, spec: dict) -> None:
        """Take the fleet's number of slots and minReadyEngines from its spec; a change of the number is
        a `FleetResize` to the listeners (the retired slots' engines as last seen)."""
        replicas = spec.get("replicas", self.replicas)
        min_ready = spec.get("minReadyEngines", self.min_ready)
        if not isinstance(replicas, int) or not isinstance(min_ready, int) or replicas < 0:
            log.warning("fleet %s: ignoring a spec of replicas %r, minReadyEngines %r", self.fleet, replicas,
                        min_ready)
            return
        before = self.replicas
        retired = tuple(self.engines()[replicas:]) if replicas < before else ()
        self.replicas, self.min_ready = replicas, min(min_ready, replicas)
        if replicas == before:
            return
        if retired:
            self._forget_slots(range(replicas, before))
        self._added.update(range(before, replicas))
        log.info("fleet %s scaled from %d to %d engine slots (minReadyEngines %d)", self.fleet, before, replicas,
                 self.min_ready)
        self._resizes.emit(FleetResize(fleet=self.fleet, replicas_before=before, replicas=replicas,
                                       min_ready=self.min_ready, retired=retired))

    def _forget_slots(self, slots: range) -> None:
        """Slots scaled away: their pods are never the slot's again (a slot added back starts afresh, its
        incarnations counted from 1 again), and what was recorded of them goes."""
        for slot in slots:
            if (pod := self._pods.pop(slot, None)) is not None:
                self._retired_uids.add(pod["metadata"]["uid"])
            for record in (self._loaded, self._marked, self._marks):
                record.pop(slot, None)
            self._had_pod.discard(slot)
            self._exported.pop(slot, None)
            self._added.discard(slot)
        gone = set(slots)
        self._reported = {key for key in self._reported if key[0] not in gone}
        self._seen_ready = {key for key in self._seen_ready if key[0] not in gone}
        self._versions = {key: v for key, v in self._versions.items() if key[0] not in gone}

    def _observe(self, slot: int, pod: dict | None, deleted: dict | None = None) -> None:
        """Emit a death the moment a pod's container terminates or the pod disappears."""
        self._had_pod.add(slot)
        if pod is not None:
            view = view_pod(pod)
            inc = view.restarts + 1
            if view.ready:
                self._seen_ready.add((slot, inc))
            failure = pod_failure(pod)
            marked_here = self._marked.get(slot) == inc
            if failure is not None and not marked_here:
                cause = DeathCause.EXITED if (slot, inc) in self._seen_ready else DeathCause.STARTUP_FAILED
                code = f" (exit code {failure.exit_code})" if failure.exit_code is not None else ""
                last_line = (failure.message.strip().splitlines() or [""])[-1]
                self._emit(slot, inc, view.pod_ip, cause, f"{failure.reason}{code}: {last_line}".strip())
        elif deleted is not None:
            view = view_pod(deleted)
            self._emit(slot, view.restarts + 1, view.pod_ip, DeathCause.EXITED, f"pod {view.name} deleted")

    def _emit(self, slot: int, incarnation: int, pod_ip: str | None, cause: DeathCause, reason: str) -> None:
        if (slot, incarnation) in self._reported or slot >= self.replicas:
            return  # reported already, or a slot scaled away (its pod ending is no death)
        self._reported.add((slot, incarnation))
        url = f"http://{pod_ip}:{self.port}" if pod_ip else None
        metrics.ENGINES_MARKED_DEAD.labels(fleet=self.fleet, reason=cause.value).inc()
        log.warning("fleet %s slot %d incarnation %d dead (%s): %s", self.fleet, slot, incarnation, cause.value,
                    reason)
        event = DeathEvent(fleet=self.fleet, slot=slot, incarnation=incarnation, url=url, cause=cause,
                           reason=reason, at=time.time(), monotonic=asyncio.get_running_loop().time())
        self._deaths.emit(event)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        self._export_states()

    def _export_states(self) -> None:
        """`rlfleet_engine_state` and `rlfleet_engine_restarts` of every slot whose view changed."""
        for engine in self.engines():
            seen = (engine.state, engine.restarts)
            if self._exported.get(engine.slot) != seen:
                self._exported[engine.slot] = seen
                metrics.set_engine_state(self.fleet, engine.slot, engine.state.value, ENGINE_STATES)
                metrics.ENGINE_RESTARTS.labels(fleet=self.fleet, slot=str(engine.slot)).set(engine.restarts)

    # FleetBackend ----------------------------------------------------------------------------------------
    def engines(self) -> list[EngineSlot]:
        entries = {e.get("slot"): e for e in self._status.get("engines", [])}
        marks = engine_marks(self._status)
        views = []
        for slot in range(self.replicas):
            pod = self._pods.get(slot)
            inc = view_pod(pod).restarts + 1 if pod else None
            views.append(slot_view(slot, pod, entries.get(slot), port=self.port, marked_dead=self._marked.get(slot),
                                   weight_version=self._versions.get((slot, inc)) if inc else None,
                                   mark=mark_of(pod, marks, slot) if pod else None, had_pod=slot in self._had_pod))
        return views

    @property
    def failure(self) -> FleetFailed | None:
        return fleet_failure(self.fleet, self._status)

    def subscribe(self, listener: DeathListener) -> Callable[[], None]:
        return self._deaths.subscribe(listener)

    def subscribe_resize(self, listener: ResizeListener) -> Callable[[], None]:
        return self._resizes.subscribe(listener)

    async def mark_dead(self, slot: int, reason: str, *, cause: DeathCause = DeathCause.REQUESTED,
                        incarnation: int | None = None) -> bool:
        if slot < 0:
            raise KeyError(f"fleet {self.fleet} has no slot {slot}")
        if slot >= self.replicas:
            return False  # scaled away meanwhile (a probe or a call was under way): nothing to mark
        view = self.engines()[slot]
        if incarnation is not None and incarnation != view.incarnation:
            return False
        if view.state not in (EngineState.STARTING, EngineState.ALIVE):
            return False
        self._marked[slot] = view.incarnation
        pod = self._pods.get(slot)
        self._emit(slot, view.incarnation, view_pod(pod).pod_ip if pod else None, cause, reason)
        self._notify()
        if pod is not None:
            self._set_mark(slot, pod, dead=cause.value, deadMessage=redact(reason)[-2000:])
            await self._write_dead_mark(slot, pod["metadata"]["name"])
        return True

    async def _write_dead_mark(self, slot: int, pod_name: str) -> None:
        """Write a dead mark; one the API server did not take is written again in the background until it
        lands. The operator recreates the pod only once it reads the mark, and the caller (a weight sync
        with engines paused, a probe) must not fail on a passing API-server error: the engine is dead
        here already."""
        try:
            await self._write_mark(slot)
        except (ApiError, OSError, TimeoutError) as e:
            if isinstance(e, ApiError) and e.not_found:
                return  # a fleet already gone takes its engines with it
            log.warning("could not mark %s dead yet (%s); writing the mark again in the background", pod_name, e)
            task = asyncio.create_task(self._write_mark_until_taken(slot, pod_name))
            self._mark_retries.add(task)
            task.add_done_callback(self._mark_retries.discard)

    async def _write_mark_until_taken(self, slot: int, pod_name: str) -> None:
        for attempt in itertools.count():
            await asyncio.sleep(exponential_backoff(attempt, MARK_RETRY_BASE_S, MARK_RETRY_MAX_S))
            try:
                if not await self._write_mark(slot):  # the slot's latest mark, which a later one may have replaced
                    return  # scaled away: its pod goes with the slot
            except (ApiError, OSError, TimeoutError) as e:
                if isinstance(e, ApiError) and e.not_found:
                    return
                log.warning("could not mark %s dead yet (attempt %d): %s", pod_name, attempt + 2, e)
            else:
                log.info("marked %s dead (attempt %d)", pod_name, attempt + 2)
                return

    def _set_mark(self, slot: int, pod: dict, **fields: str) -> None:
        """Update the slot's mark here; a mark of another pod (an earlier incarnation) starts afresh."""
        uid = pod["metadata"]["uid"]
        mark = self._marks.get(slot)
        if mark is None or mark.get("podUID") != uid:
            mark = {"podUID": uid, "dead": None, "deadMessage": None, "weightVersion": None}  # None: removed
        self._marks[slot] = {**mark, **fields}

    async def _write_mark(self, slot: int) -> bool:
        """Write the slot's latest mark into the fleet status; False when it has none (scaled away). Writes
        are serialized and each sends the mark as it is when sent, so the last write to land is always the
        newest mark."""
        async with self._mark_lock:
            if (mark := self._marks.get(slot)) is None:
                return False  # the slot was scaled away meanwhile: its pod goes with it, marked or not
            await self.kube.merge_patch(self._fleet_res, self.fleet, engine_mark_patch(slot, mark),
                                        self.namespace, sub="status")
            return True

    async def recover(self) -> list[int]:
        """The operator recreates dead slots; this reports the slots being recreated or recreated since
        the last wait (a new pod whose weights nobody has loaded yet), or raises the fleet's failure."""
        if (failure := self.failure) is not None:
            raise failure
        return [e.slot for e in self.engines() if recreated_since(e, self._loaded.get(e.slot))]

    async def wait_all_alive(self, timeout: float | None = None) -> list[EngineSlot]:  # noqa: ASYNC109 - the bound ends in FleetNotReady, not a cancel
        """Wait (bounded) until every slot serves or is given up; a slot added by a scale-up that has not
        served yet is not waited for once minReadyEngines serve (it is loaded at the first sync after it
        is Ready: a scale-up does not hold a sync up for the time an engine takes to start)."""
        bound = self.recovery.wait_all_alive_timeout_seconds if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bound
        while True:
            if (failure := self.failure) is not None:
                raise failure
            if all_settled(self.engines(), self.min_ready, not_waited_for=self._added):
                break
            changed = self._changed
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await changed.wait()
        alive = [e for e in self.engines() if e.state is EngineState.ALIVE]
        for e in alive:  # the caller loads its weights on these (bring-up or sync)
            self._loaded[e.slot] = e.incarnation
            self._added.discard(e.slot)
        if len(alive) < self.min_ready:
            raise fleet_not_ready(self, len(alive), bound)
        return alive

    def record_weight_version(self, slot: int, incarnation: int, version: str) -> None:
        self._versions[(slot, incarnation)] = version
        pod = self._pods.get(slot)
        if pod is None or view_pod(pod).restarts + 1 != incarnation:
            return
        self._set_mark(slot, pod, weightVersion=version)
        task = asyncio.create_task(self._write_mark_quietly(slot))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _write_mark_quietly(self, slot: int) -> None:
        try:
            await self._write_mark(slot)
        except (ApiError, OSError, TimeoutError) as e:
            log.warning("recording the weight version of %s slot %d: %s", self.fleet, slot, e)


@dataclass(frozen=True)
class RouterAddress:
    """A ready router pod's URL, and which run of its router process serves there: the pod's UID and its
    router container's restart count (a container restarted in place keeps the address and forgets its workers)."""

    url: str
    incarnation: str


async def router_address(kube: KubeClient, namespace: str, fleet: str, port: int, *, fleet_uid: str,
                         prefer: str | None = None) -> RouterAddress | None:
    """The address of a ready router pod of the fleet (pod addresses are routable inside the cluster);
    `prefer` (the one in use) while it is still ready, so two ready replicas do not make it flap.

    Only the pods of the fleet's own router count: owned by a ReplicaSet that the router Deployment
    owns, which the fleet (`fleet_uid`) owns. A pod that merely has the router labels is ignored.
    """
    selector = f"{conventions.LABEL_COMPONENT}=router,{conventions.LABEL_FLEET}={fleet}"
    deployment = await kube.get_or_none(DEPLOYMENTS, conventions.router_name(fleet), namespace)
    if deployment is None or not owned_by(deployment, fleet_uid):
        return None
    replica_sets = await kube.list(REPLICASETS, namespace, label_selector=selector)
    pods = await kube.list(PODS, namespace, label_selector=selector)
    own = owned_router_pods(pods.get("items", []), replica_sets.get("items", []), deployment, fleet_uid)
    return pick_router(own, port, prefer=prefer)


def pick_router(pods: list[dict], port: int, *, prefer: str | None = None) -> RouterAddress | None:
    """Pure part of `router_address`."""
    ready = [RouterAddress(f"http://{v.pod_ip}:{port}", f"{v.uid}/{_container_restarts(pod)}")
             for pod, v in ((p, view_pod(p)) for p in pods) if v.ready and v.pod_ip and not v.terminating]
    return next((a for a in ready if a.url == prefer), ready[0] if ready else None)


def router_change(in_use: str | None, serving: str | None, address: RouterAddress) -> str | None:
    """How the router a fleet's clients use changed: "moved" (another address: a replacement pod),
    "restarted" (the same address, another incarnation `serving` was seen before: its container restarted
    in place and forgot its workers), or None."""
    if address.url != in_use:
        return "moved"
    return "restarted" if serving is not None and address.incarnation != serving else None


def _container_restarts(pod: dict) -> int:
    return sum(int_or(s.get("restartCount")) for s in (pod.get("status") or {}).get("containerStatuses") or []
               if s.get("name") == conventions.ROUTER_CONTAINER)


TRAININGRUNS = rlfleet_resource("TrainingRun")
# The TrainingRun status fields the orchestrator owns; the operator writes the others.
ORCHESTRATOR_STATUS_KEYS = ("step", "weightVersion", "rewardMean", "lastEval", "orchestratorFailure", "trainer")


async def report_run_progress(kube: KubeClient, namespace: str, run: str, **fields) -> None:
    """Write the orchestrator's part of a TrainingRun's status (step, weightVersion, rewardMean, lastEval).

    Keyword names are the status' camelCase names; anything else is refused so the two writers never
    overwrite each other's fields.
    """
    unknown = set(fields) - set(ORCHESTRATOR_STATUS_KEYS)
    if unknown:
        raise ValueError(f"not orchestrator-owned status fields: {sorted(unknown)}")
    await kube.merge_patch(TRAININGRUNS, run, {"status": fields}, namespace, sub="status")


async def fail_run(kube: KubeClient, namespace: str, run: str, *, reason: str, message: str) -> None:
    """Fail the run from the orchestrator (e.g. reason RolloutEnginesUnavailable, the engines' log lines).

    Written as the run's `status.orchestratorFailure`, never into the status conditions the operator
    owns; the operator turns it into the run's Failed condition.
    """
    await kube.merge_patch(TRAININGRUNS, run, run_failure_patch(reason[:1024], redact(message)[-30000:]),
                           namespace, sub="status")


async def pin_fleet_snapshot(kube: KubeClient, namespace: str, fleet: str, *, model_path: str, weight_version: str,
                             kind: str = "RolloutFleet") -> None:
    """Record the snapshot replacement engines of a fleet start from (after each weight sync), in the
    fleet's `status.orchestrator` (used by the operator only under the fleet's snapshot mount)."""
    await kube.merge_patch(rlfleet_resource(kind), fleet, pin_patch(model_path, weight_version), namespace,
                           sub="status")


FLEET_POLL_S = 2.0


async def attach_fleet(kube: KubeClient, namespace: str, fleet: str, *, kind: str = "RolloutFleet",
                       timeout: float, owner_uid: str | None) -> tuple[KubernetesBackend, RouterAddress, dict]:  # noqa: ASYNC109 - the bound ends in FleetNotReady, not a cancel
    """Wait (bounded) until the operator has created `fleet` and its router pod is ready.

    Returns the backend (not started), the router's address and the fleet object. The trainer pod starts
    beside the fleets it drives, so both may still be coming up. `owner_uid`: the run's UID; a fleet
    of that name that the run does not own is never attached (None: a fleet of no run).
    """
    res = rlfleet_resource(kind)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    waiting_for = f"{kind} {fleet}"
    while True:
        obj = await kube.get_or_none(res, fleet, namespace)
        if obj is not None and owner_uid is not None and not owned_by(obj, owner_uid):
            waiting_for = (f"{kind} {fleet} owned by the run (uid {owner_uid}); the {kind} of that name is not "
                           f"the run's, so it is not used")
        elif obj is not None:
            port = FleetSpec.model_validate(obj["spec"]).router.port
            waiting_for = f"a ready router pod of {kind} {fleet}"
            address = await router_address(kube, namespace, fleet, port, fleet_uid=obj["metadata"]["uid"])
            if address is not None:
                backend = await KubernetesBackend.connect(kube, namespace=namespace, fleet=fleet, kind=kind)
                return backend, address, obj
        if loop.time() + FLEET_POLL_S > deadline:
            raise FleetNotReady(f"no {waiting_for} in namespace {namespace} within {timeout:g} s")
        await asyncio.sleep(FLEET_POLL_S)
