"""An external evaluator (posture external) with an SGLang server of its own, pinned to each snapshot.

    eval:
      posture: external
      external:
        classPath: external_eval:ExternalSglangEval   # this file; `rlfleet run` finds it next to the manifest
        args: {device: cpu}
      datasets: [{name: reverse, task: reverse, maxPrompts: 32}]

With `url` (or the environment variable RLFLEET_EXTERNAL_EVAL_URL) it attaches to a server you run
and leaves it running. Otherwise it starts one on a loopback address of its own (launch weights: a
private copy of the first snapshot it is given) and stops it in dispose().

For every point it probes the server, loads the snapshot with `update_weights_from_disk` and the
weight version "<step>", reads the version back from `/model_info` (two tries; still wrong: the
point is skipped `pin_violation`), then generates and scores the run's eval datasets on it.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import aiohttp

from rlfleet.crds.specs import EngineSpec, RecoverySpec
from rlfleet.orchestrator.evaluation.api import CheckpointEvalFn, EvalOutcome, EvalRequest, EvalSkip
from rlfleet.orchestrator.evaluation.generate import evaluate_datasets
from rlfleet.orchestrator.fleet.errors import FleetFailed, FleetNotReady
from rlfleet.sglang.engine import EngineClient, EngineTimeouts, pin_weights
from rlfleet.sglang.errors import CallError

URL_ENV = "RLFLEET_EXTERNAL_EVAL_URL"


class ExternalSglangEval(CheckpointEvalFn):
    def __init__(self, url: str | None = None, device: str = "cpu", max_total_tokens: int = 8192,
                 extra_args: list[str] | None = None, work_dir: str | None = None,
                 startup_timeout_s: float = 900.0, pin_retries: int = 2, pin_timeout_s: float = 600.0,
                 generate_timeout_s: float = 300.0):
        self.url = url or os.environ.get(URL_ENV)
        self.device = device
        self.max_total_tokens = max_total_tokens
        self.extra_args = list(extra_args or [])
        self.startup_timeout_s = startup_timeout_s
        self.pin_retries = pin_retries
        self.pin_timeout_s = pin_timeout_s
        self.generate_timeout_s = generate_timeout_s
        self._own_work_dir = work_dir is None
        self.work_dir = Path(work_dir) if work_dir else None
        self._backend = None  # our own server (a one-slot local fleet), when not attached
        self._session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()
        self.pinned: list[str] = []  # versions read back after each pin

    # --- the contract ----------------------------------------------------------------------------

    async def evaluate_checkpoint(self, checkpoint_dir: str, request: EvalRequest) -> EvalOutcome:
        async with self._lock:  # one server: one version at a time
            url = await self._server_url(checkpoint_dir)
            client = EngineClient(self._http(), url, EngineTimeouts(load=self.pin_timeout_s))
            try:
                await client.health_generate(timeout_s=30.0)
            except CallError as exc:
                raise EvalSkip("unhealthy", f"eval server {url}: {exc}") from exc
            version = await self._pin(client, checkpoint_dir, request.weight_version)
            scores = await evaluate_datasets(self._http(), url, request.datasets, expected_version=version,
                                             timeout_s=self.generate_timeout_s,
                                             rid_prefix=f"external-{request.run}-{request.step}")
        return EvalOutcome(weight_version=version, datasets=scores, engine_versions={url: version})

    async def dispose(self) -> None:
        try:
            if self._backend is not None:
                await self._backend.stop()
        finally:
            if self._session is not None:
                await self._session.close()
            if self._own_work_dir and self.work_dir is not None:
                shutil.rmtree(self.work_dir, ignore_errors=True)

    # --- the server --------------------------------------------------------------------------------

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _server_url(self, first_checkpoint: str) -> str:
        if self.url:
            return self.url.rstrip("/")
        from rlfleet.orchestrator.fleet.backend import EngineState
        from rlfleet.orchestrator.fleet.local_backend import LocalBackend

        if self._backend is None:
            if self.work_dir is None:
                self.work_dir = Path(tempfile.mkdtemp(prefix="rlfleet-external-eval-"))
            launch = self.work_dir / "launch-weights"
            if not launch.exists():  # snapshots are deleted after use: launch from a private copy
                await asyncio.to_thread(shutil.copytree, first_checkpoint, launch)
            engine = EngineSpec(model_path=str(launch), device=self.device,
                                gpus_per_engine=0 if self.device == "cpu" else 1,
                                max_total_tokens=self.max_total_tokens, extra_args=self.extra_args)
            self._backend = LocalBackend(engine=engine, replicas=1, recovery=RecoverySpec(), run_dir=self.work_dir,
                                         fleet="external-eval", weight_version="launch",
                                         startup_timeout_s=self.startup_timeout_s)
            await self._backend.start()
        try:
            await self._backend.recover()  # a server that died since the last point comes back
            alive = await self._backend.wait_all_alive(self.startup_timeout_s)
        except (FleetNotReady, FleetFailed) as exc:
            raise EvalSkip("unhealthy", str(exc)) from exc
        engine = next(e for e in alive if e.state is EngineState.ALIVE)
        assert engine.url is not None
        return engine.url

    async def _pin(self, client: EngineClient, checkpoint_dir: str, version: str) -> str:
        last = "no attempt"
        for _attempt in range(self.pin_retries):
            try:
                # Nothing generates on this server between points: no pause; a refused load is tried again whole.
                pinned = await pin_weights(client, checkpoint_dir, version, load_timeout_s=self.pin_timeout_s,
                                           flush_attempts=0)
            except CallError as exc:
                last = str(exc)
                if exc.engine_gone:
                    break
                continue
            if pinned.serves(version):
                self.pinned.append(version)
                return version
            last = pinned.load.message if not pinned.load.success else f"reports version {pinned.served!r}"
        raise EvalSkip("pin_violation", f"version {version} not pinned on {client.base_url}: {last}")
