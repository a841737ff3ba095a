"""`rlfleet run FILE`: one TrainingRun on this machine, engines and routers as local processes.

The training loop is `RunLoop`'s; this starts the router and the engines (one process group each, on
its own 127.0.0.N), the eval fleet of posture fleet likewise, and, with `--chaos`, kills an engine now
and then so recovery can be watched. Each fleet's router is supervised like its engines: restarted
when it exits, within `router.maxRestarts`, its engines registered again (RouterSupervisor).
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import signal
from pathlib import Path

from rlfleet.crds.derive import eval_fleet_spec, rollout_engine
from rlfleet.crds.models import TrainingRun
from rlfleet.orchestrator.fleet.backend import EngineState
from rlfleet.orchestrator.fleet.local_backend import LocalBackend
from rlfleet.orchestrator.fleet.local_router import LocalRouter, RouterSupervisor
from rlfleet.orchestrator.fleet.runtime import FleetRuntime
from rlfleet.orchestrator.run.local_gpus import plan_local_gpus
from rlfleet.orchestrator.run.loop import RunFailed, RunLoop, RunOptions, resolve_model_dir, snapshot_dir
from rlfleet.sglang.http import new_api_key
from rlfleet.sglang.launch import ServedWeights
from rlfleet.snapshot.volume import default_local_volume, is_scratch_volume

__all__ = ["LocalRun", "RunFailed", "RunOptions", "resolve_model_dir", "snapshot_dir"]


class LocalRun(RunLoop):
    def __init__(self, run: TrainingRun, options: RunOptions):
        local_path = run.spec.weight_sync.snapshot_volume.local_path
        snapshots = Path(local_path or default_local_volume(options.run_dir))
        # A volume chosen on tmpfs is scratch memory: removed when the run ends (set localPath to keep it).
        super().__init__(run, options, snapshots=snapshots,
                         scratch_volume=local_path is None and is_scratch_volume(snapshots))
        self.backend: LocalBackend | None = None
        self.router: LocalRouter | None = None
        self.eval_router: LocalRouter | None = None
        self.eval_runtime: FleetRuntime | None = None
        self.supervisors: dict[str, RouterSupervisor] = {}
        # A fresh key per run: the local engines and routers listen on this machine's ports.
        self.api_key = new_api_key()
        # The trainer and every CUDA engine on GPUs of their own (`rlfleet run` checked they are there).
        self.gpus = plan_local_gpus(run.spec, eval_fleet_spec(self.name or "", run.spec))

    async def _start_rollout(self, stack: contextlib.AsyncExitStack) -> str:
        spec = self.spec
        self._phase("starting the router")
        router = LocalRouter(self.options.run_dir, health_interval_s=spec.rollout.router.health_check_interval_seconds,
                             health_failure_threshold=spec.rollout.router.health_failure_threshold,
                             api_key=self.api_key, policy=spec.rollout.router.policy)
        stack.push_async_callback(router.stop)  # before the start: a cancel during its wait stops it too
        router_url = await router.start()
        self.router = router

        self._phase(f"starting {spec.rollout.replicas} engines")
        if self.gpus.needed:
            self.progress.event(f"run {self.name}: {self.gpus.describe()}")
        engine = rollout_engine(spec).model_copy(update={"model_path": str(self.current_snapshot)})
        self.backend = LocalBackend(engine=engine, replicas=spec.rollout.replicas, recovery=spec.rollout.recovery,
                                    run_dir=self.options.run_dir, min_ready=spec.rollout.min_ready_engines,
                                    weight_version=self.launch_version, api_key=self.api_key,
                                    gpu_bases=self.gpus.rollout,
                                    startup_timeout_s=spec.rollout.health.startup_timeout_seconds)
        self.backend.count_earlier_restarts(self._recreated_before)  # a resumed run's budget goes on
        self.fleet = FleetRuntime(self.backend, router_url, health=spec.rollout.health,
                                  weight_sync=spec.weight_sync, reference=self.current_snapshot,
                                  api_key=self.api_key,
                                  broadcast_device="cuda" if spec.trainer.gpus > 0 else "cpu",
                                  served=ServedWeights.of(engine))
        return router_url

    def _checkpoint_root(self) -> Path:
        """Locally never on a scratch volume: under snapshotVolume.localPath when set, else runs/<name>/."""
        assert self.spec.checkpoint is not None
        local_path = self.spec.weight_sync.snapshot_volume.local_path
        base = Path(local_path) if local_path else Path("runs") / self.name
        return base / self.spec.checkpoint.path

    def _tracker_dir(self, relative: str) -> Path:
        """Locally never on a scratch volume: under snapshotVolume.localPath when set, else the run directory;
        one subdirectory per run (the run directory's name)."""
        local_path = self.spec.weight_sync.snapshot_volume.local_path
        base = Path(local_path) if local_path else self.options.run_dir
        return base / relative / self.options.run_dir.name

    def _eval_fleet_factory(self):
        from rlfleet.orchestrator.evaluation.postures.fleet import start_local_eval_fleet

        async def start(launch_model: Path):
            fleet, router = await start_local_eval_fleet(self.name, self.spec, launch_model=launch_model,
                                                         run_dir=self.options.run_dir,
                                                         python=self.options.eval_engine_python,
                                                         api_key=self.api_key, gpu_bases=self.gpus.evaluation)
            assert isinstance(router, LocalRouter)
            self.eval_router, self.eval_runtime = router, fleet.runtime
            return fleet, router

        return start

    def _background(self) -> list:
        spec = self.spec
        assert self.router is not None and self.fleet is not None
        tasks = [self._supervise("rollout", self.router, self.fleet, spec.rollout.router.max_restarts,
                                 spec.rollout.recovery)]
        fleet_spec = eval_fleet_spec(self.name or "", spec) if spec.eval is not None else None
        if self.eval_router is not None and self.eval_runtime is not None and fleet_spec is not None:
            tasks.append(self._supervise("eval", self.eval_router, self.eval_runtime, fleet_spec.router.max_restarts,
                                         fleet_spec.recovery))
        if self.options.chaos:
            tasks.append(self._chaos())
        return tasks

    def _rollout_gpu_bases(self) -> tuple[int, ...]:
        return self.gpus.rollout

    def _supervise(self, fleet: str, router: LocalRouter, runtime: FleetRuntime, max_restarts: int, recovery):
        supervisor = RouterSupervisor(router, fleet=fleet, max_restarts=max_restarts, recovery=recovery,
                                      on_restart=runtime.router_restarted,
                                      on_event=lambda message: self._on_router_event(fleet, message))
        self.supervisors[fleet] = supervisor
        return supervisor.run()

    def _count_recoveries(self) -> None:
        super()._count_recoveries()
        self.summary.router_restarts = {fleet: s.restored for fleet, s in self.supervisors.items()}

    def _router_logs(self) -> dict[str, list[str]]:
        routers = (("rollout", self.router), ("eval", self.eval_router))
        return {f"{name} router": router.tail() for name, router in routers if router is not None}

    async def _chaos(self) -> None:
        rng = random.Random()
        while True:
            await asyncio.sleep(rng.uniform(0.5, 1.5) * self.options.chaos_interval_s)
            assert self.backend is not None, "chaos starts once the rollout fleet has"
            alive = [e for e in self.backend.engines() if e.state is EngineState.ALIVE]
            if not alive:
                continue
            victim = rng.choice(alive)
            process = self.backend.process(victim.slot)
            if process is not None:
                self.progress.event(f"chaos: SIGKILL engine slot {victim.slot} ({victim.url})", self.state)
                process.signal_group(signal.SIGKILL)
