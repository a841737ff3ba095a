"""`rlfleet run --kubernetes`: a TrainingRun's orchestrator and trainer, inside its trainer pod.

The operator created the run's fleets, their routers and this pod; this drives them through the API
server with the pod's own ServiceAccount (RBAC: read the fleets, their pods and the run; patch only the
status of fleets and runs, never a pod or a spec; see `rlfleet.kube.marks`):

- the rollout fleet is attached with the Kubernetes backend: a dead engine is marked in the fleet's
  `status.orchestrator` and the operator recreates it; the next weight sync waits for the replacement and
  loads the current weights on it before it rejoins the router;
- after each step's sync: `status.step`, `weightVersion`, `rewardMean` are written, and the fleet is
  pinned to the new snapshot (`status.orchestrator.modelPath`, `weightVersion`) so replacements start
  from it;
- eval posture fleet: the run's EvalFleet, pinned per point the same way; `status.lastEval` is written
  after every settled point;
- a failure (watchdog trip, fleet crash loop, ...) is written as the run's `status.orchestratorFailure`,
  which the operator makes its Failed condition; exit status 0 means the
  run Succeeded;
- a trainer pod the operator recreated (spec.trainer.maxRestarts) runs with `--resume`: it restores the
  newest complete checkpoint on the claim and attaches to the engines its predecessor left running.
  They serve later weights than the checkpoint's, so they are brought to the checkpoint's by a weight
  sync before the first rollout; `status.step` goes back to the checkpoint's step, and the steps after
  it are trained again (each once in the summary).

Snapshots live on the run's shared claim, mounted at `$RLFLEET_SNAPSHOT_DIR` in this pod and in every
engine pod, so paths written here are valid there.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from rlfleet.crds import conventions
from rlfleet.crds.derive import eval_fleet_spec
from rlfleet.crds.fleet_specs import FleetSpec
from rlfleet.crds.managed import ReservedEnv
from rlfleet.crds.models import TrainingRun
from rlfleet.kube.client import ApiError, KubeClient
from rlfleet.observability import metrics
from rlfleet.orchestrator.evaluation.policy import EvalPoint
from rlfleet.orchestrator.fleet.errors import RouterFailed
from rlfleet.orchestrator.fleet.k8s_backend import (
    attach_fleet,
    pin_fleet_snapshot,
    report_run_progress,
    router_address,
    router_change,
)
from rlfleet.orchestrator.fleet.runtime import FleetRuntime
from rlfleet.orchestrator.guards.heat_guard import EnginePods
from rlfleet.orchestrator.run.loop import RunFailed, RunLoop, RunOptions
from rlfleet.sglang.launch import ServedWeights

log = logging.getLogger(__name__)


class KubernetesRun(RunLoop):
    def __init__(self, run: TrainingRun, options: RunOptions, *, kube: KubeClient, namespace: str, snapshots: Path,
                 run_uid: str):
        super().__init__(run, options, snapshots=snapshots)
        self.kube = kube
        self.namespace = namespace
        self.run_uid = run_uid  # the fleets driven are the ones this run owns, whatever else has its runName
        self._fleet_uids: dict[str, str] = {}
        self.rollout_fleet = conventions.rollout_fleet_name(self.name)
        self._status_writes: set[asyncio.Task] = set()
        self._pending_retire: Path | None = None
        self._eval_runtime: FleetRuntime | None = None
        self._router_ports: dict[str, int] = {}
        self._router_budgets: dict[str, int] = {}
        self._router_incarnations: dict[str, str] = {}  # fleet -> its router's incarnation when attached
        # The run's fleets' key, from their Secret (the pod's env, secretKeyRef).
        self.api_key = os.environ.get(conventions.API_KEY_ENV) or None

    async def _start_rollout(self, stack: contextlib.AsyncExitStack) -> str:
        spec = self.spec
        # Every rank joined the trainer's process group (building the trainer waited for them).
        world = spec.trainer.world_size
        await self._write_status(trainer={"ranks": world, "ready": world})
        # Broadcast: this pod's orchestrator is rank 0 of the update group, on its own pod IP (downward
        # API) and the pod's declared update-group port; engines are told that address when they join.
        pod_ip = os.environ.get(ReservedEnv.POD_IP, "")
        if spec.weight_sync.mode == "broadcast" and not pod_ip:
            raise RunFailed("WeightSyncUnsupported", f"spec.weightSync.mode: broadcast needs the pod's address in "
                                                     f"${ReservedEnv.POD_IP} (status.podIP); it is not set")
        self._phase("waiting for the rollout fleet")
        backend, router, obj = await attach_fleet(self.kube, self.namespace, self.rollout_fleet,
                                                  timeout=spec.rollout.health.startup_timeout_seconds,
                                                  owner_uid=self.run_uid)
        url = router.url
        self._router_incarnations[self.rollout_fleet] = router.incarnation
        self._fleet_uids[self.rollout_fleet] = obj["metadata"]["uid"]
        rollout_router = FleetSpec.model_validate(obj["spec"]).router
        self._router_ports[self.rollout_fleet] = rollout_router.port
        self._router_budgets[self.rollout_fleet] = rollout_router.max_restarts
        self.progress.event(f"rollout fleet {self.rollout_fleet}: router {url}", self.state)
        # Replacements start from the trainer's own copy of the launch weights from now on.
        await pin_fleet_snapshot(self.kube, self.namespace, self.rollout_fleet,
                                 model_path=str(self.current_snapshot), weight_version=self.launch_version)
        self._phase(f"waiting for {spec.rollout.replicas} engines")
        self.backend = backend
        self.fleet = FleetRuntime(backend, url, health=spec.rollout.health, weight_sync=spec.weight_sync,
                                  reference=self.current_snapshot, api_key=self.api_key,
                                  broadcast_address=pod_ip or "127.0.0.1",
                                  broadcast_port=conventions.UPDATE_GROUP_PORT,
                                  broadcast_device="cuda" if spec.trainer.gpus > 0 else "cpu",
                                  served=ServedWeights.of(spec.rollout.engine))
        stack.push_async_callback(self._flush_status_writes)
        return url

    async def _open_checkpoints(self, trainer, stack: contextlib.AsyncExitStack) -> None:
        await super()._open_checkpoints(trainer, stack)
        # The fleet's engines outlive a trainer pod: their recreations are counted by the fleet (the pods'
        # restart annotations), so the checkpoint's count is already in what the backend reports.
        self._recreated_before = 0

    async def _bring_up(self, timeout_s: float) -> None:
        """Admit engines serving the launch weights; engines a previous trainer pod left serving other
        weights (it was recreated) get the launch weights by a sync first, before any rollout."""
        assert self.fleet is not None and self.backend is not None and self.launch_snapshot is not None
        alive = await self.backend.wait_all_alive(timeout_s)
        served = await asyncio.gather(*(self._served_version(e.url) for e in alive if e.url))
        if all(version == self.launch_version for version in served):
            await self.fleet.bring_up(self.launch_version, timeout=timeout_s)
            return
        self.progress.event(f"engines serve weight versions {sorted({str(v) for v in served})}: loading the launch "
                            f"weights v{self.launch_version} into them before any rollout", self.state)
        await self.fleet.sync_weights(self.launch_snapshot, self.start_step)
        await self._write_status(step=self.start_step, weightVersion=self.launch_version)

    async def _served_version(self, url: str) -> str | None:
        assert self.fleet is not None
        try:
            return await self.fleet.engine_client(url).weight_version(timeout_s=10.0)
        except Exception as exc:  # an engine that does not answer gets the sync too
            log.warning("reading the weight version of %s: %s", url, exc)
            return None

    def _eval_fleet_factory(self):
        from rlfleet.orchestrator.evaluation.postures.fleet import PinnedEvalFleet

        async def start(launch_model: Path):
            name = conventions.eval_fleet_name(self.name)
            # The eval engines' own startup bound (an eval fleet may serve a larger engine than rollout's).
            expected = eval_fleet_spec(self.name, self.spec)
            assert expected is not None, "the eval fleet starts only for posture fleet"
            backend, router, obj = await attach_fleet(self.kube, self.namespace, name, kind="EvalFleet",
                                                      timeout=expected.health.startup_timeout_seconds,
                                                      owner_uid=self.run_uid)
            url = router.url
            self._router_incarnations[name] = router.incarnation
            self._fleet_uids[name] = obj["metadata"]["uid"]
            fleet_spec: FleetSpec = FleetSpec.model_validate(obj["spec"])
            self._router_ports[name] = fleet_spec.router.port
            self._router_budgets[name] = fleet_spec.router.max_restarts
            runtime = FleetRuntime(backend, url, health=fleet_spec.health, weight_sync=self.spec.weight_sync,
                                   api_key=self.api_key)
            await runtime.start()
            self._eval_runtime = runtime
            assert self.spec.eval is not None, "the eval fleet starts only for a run with eval"
            evaluator = PinnedEvalFleet(runtime, self.spec.eval,
                                  wait_alive_timeout_s=fleet_spec.recovery.wait_all_alive_timeout_seconds)
            return evaluator, None

        return start

    def _engine_placement(self) -> EnginePods:
        return EnginePods(self.namespace)  # the engines are pods on their own nodes: no GPU of this pod's

    def _background(self) -> list:
        assert self.fleet is not None, "background tasks start once the rollout fleet has"
        followed = [(self.fleet, self.rollout_fleet)]
        if self._eval_runtime is not None:
            followed.append((self._eval_runtime, conventions.eval_fleet_name(self.name)))
        return [self._follow_router(runtime, fleet) for runtime, fleet in followed]

    async def _follow_router(self, runtime: FleetRuntime, fleet: str) -> None:
        """A replaced router pod has a new address: move the fleet's clients there (the Deployment
        recreates the pod; the membership re-registers the engines); a router container restarted in its
        pod keeps the address but knows no worker: register them again. More of either than the router's
        maxRestarts fail the run (RouterFailed), as a local router's exits do."""
        interval = max(1.0, runtime.health_spec.interval_seconds)
        budget = self._router_budgets.get(fleet, 0)
        label = "eval" if fleet != self.rollout_fleet else "rollout"
        metrics.ROUTER_RESTART_BUDGET.labels(fleet=label).set(budget)
        metrics.ROUTER_RESTARTS.labels(fleet=label)
        moves = 0
        serving = self._router_incarnations.get(fleet)  # the router at runtime.router_url when attached
        while True:
            await asyncio.sleep(interval)
            try:
                address = await router_address(self.kube, self.namespace, fleet, self._router_ports[fleet],
                                               fleet_uid=self._fleet_uids[fleet], prefer=runtime.router_url)
            except (ApiError, OSError, TimeoutError) as exc:
                log.warning("looking up the router of %s: %s", fleet, exc)
                continue
            if address is None:
                continue
            change = router_change(runtime.router_url, serving, address)
            serving = address.incarnation
            if change is None:
                continue
            moves += 1
            where = f"{runtime.router_url} -> {address.url}" if change == "moved" else f"at {address.url}"
            if moves > budget:
                raise RouterFailed(f"fleet {fleet}: the router was replaced or restarted {moves} times, more than "
                                   f"its maxRestarts {budget}; last {change} {where}")
            self._on_router_event(label, f"router {change} {where} (replacement {moves} of {budget})")
            metrics.ROUTER_RESTARTS.labels(fleet=label).inc()
            self.summary.router_restarts[label] = moves
            await runtime.router_restarted(address.url)

    async def _after_sync(self, step: int, stats: dict) -> None:
        await self._write_status(step=step, weightVersion=str(step), rewardMean=round(float(stats["reward_mean"]), 6))

    async def _pin_snapshot(self, step: int, snapshot: Path) -> None:
        # Best effort: an API hiccup must not stop training. A stale pin only means a replacement starts
        # from older weights, and the next sync loads the current ones before it serves.
        try:
            await pin_fleet_snapshot(self.kube, self.namespace, self.rollout_fleet, model_path=str(snapshot),
                                     weight_version=str(step))
        except (ApiError, OSError, TimeoutError) as exc:
            log.warning("pinning %s to %s: %s", self.rollout_fleet, snapshot, exc)

    async def _retire_snapshot(self, path: Path | None) -> None:
        # A replacement pod created just before the pin moved on may still be starting from the previous
        # snapshot: keep it one step longer.
        previous, self._pending_retire = self._pending_retire, path
        await super()._retire_snapshot(previous)

    def _on_eval(self, point: EvalPoint) -> None:
        super()._on_eval(point)
        assert self.evaluation is not None
        last = self.evaluation.last_eval_status()
        if last is None:
            return
        fields = last.model_dump(by_alias=True, exclude_none=True, mode="json")
        task = asyncio.get_running_loop().create_task(self._write_status(lastEval=fields))
        self._status_writes.add(task)
        task.add_done_callback(self._status_writes.discard)

    async def _write_status(self, **fields) -> None:
        try:
            await report_run_progress(self.kube, self.namespace, self.name, **fields)
        except (ApiError, OSError, TimeoutError) as exc:  # status is best effort; the run goes on
            log.warning("writing status %s of %s: %s", sorted(fields), self.name, exc)

    async def _flush_status_writes(self) -> None:
        await asyncio.gather(*self._status_writes, return_exceptions=True)
