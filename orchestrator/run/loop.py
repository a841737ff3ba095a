"""The training loop of one TrainingRun, whichever platform runs its engines.

`LocalRun` (orchestrator/run/local.py) runs the engines and routers as local processes;
`KubernetesRun` (orchestrator/run/kubernetes.py) drives the fleets the operator runs as pods. Both run this
loop, through the same models:

    export step_0 -> fleet up (launch weights "0") -> admit engines after read-back
    fully-async producer keeps the engines busy through the router
    each step: take prompts_per_step fresh-enough groups -> train -> export step_N -> weight sync
               (recover dead slots first, load, read back every engine's version, admit replacements)
    the 503 watchdog, the health monitor and (spec.heatGuard.enabled) the heat guard run beside it;
    steps that overlapped a heat pause are flagged in the summary; Ctrl-C stops everything cleanly.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from rlfleet.crds.derive import parse_tiny_model
from rlfleet.crds.fleet_specs import RolloutTemplateSpec
from rlfleet.crds.models import TrainingRun
from rlfleet.crds.specs import literal_env
from rlfleet.errors import RunError
from rlfleet.observability import metrics
from rlfleet.orchestrator.evaluation.policy import EvalPoint
from rlfleet.orchestrator.evaluation.run import RunEvaluation
from rlfleet.orchestrator.fleet.backend import DeathEvent, EngineState, FleetBackend, FleetResize
from rlfleet.orchestrator.fleet.runtime import FleetRuntime
from rlfleet.orchestrator.fleet.weight_sync import WeightSyncResult
from rlfleet.orchestrator.guards.heat_guard import (
    EnginePlacement,
    HeatEvent,
    HeatGuardTask,
    LocalEngines,
    check_heat_guard,
    engine_visible_devices,
    heat_guard_for,
)
from rlfleet.orchestrator.guards.watchdog import WatchdogTask
from rlfleet.orchestrator.rollout.client import (
    CONNECT_TIMEOUT_S,
    RetryPolicy,
    RolloutClient,
    post_generate,
    probe_health,
)
from rlfleet.orchestrator.rollout.producer import RolloutProducer, SamplingSettings, groups_in_flight
from rlfleet.orchestrator.rollout.stream import stream_generate
from rlfleet.orchestrator.run.checkpointing import (
    ResumePoint,
    RunCheckpoints,
    restore_summary,
    run_state,
    summary_state,
)
from rlfleet.orchestrator.run.metrics_server import MetricsServer
from rlfleet.orchestrator.run.progress import ProgressReporter, ProgressState, engine_label, startup_stage
from rlfleet.orchestrator.run.summary import (
    RunEvent,
    RunSummary,
    StepRecord,
    format_phases,
    record_to_dict,
    reward_std,
    staleness_of,
)
from rlfleet.orchestrator.run.tracking import RunTrackers, TrackerUnavailable, build_sinks
from rlfleet.orchestrator.run.trainer_setup import LeadingTrainer, build_run_trainer, ranks_label
from rlfleet.orchestrator.run.trainer_setup import describe as describe_trainer
from rlfleet.sglang.http import client_session, fleet_connector
from rlfleet.snapshot.retention import snapshots_to_retire
from rlfleet.snapshot.writer import ExportState, write_hf_snapshot
from rlfleet.trainer import checkpoint as ckpt
from rlfleet.trainer import grpo
from rlfleet.util.aio import first_error, resolved, settle
from rlfleet.util.binaries import CACHE_DIR
from rlfleet.util.procs import outer_environment, tail_file

log = logging.getLogger(__name__)


class RunFailed(RunError):
    """The run could not finish; `reason` is a CamelCase word as in Kubernetes conditions.

    What the run loop raises: any other RunError (the watchdog's trip, a crash-looping fleet, an
    invalid snapshot, ...) ends the run as a RunFailed with that error's reason and message.
    """

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}", reason=reason)
        self.message = message


@dataclass
class RunOptions:
    run_dir: Path
    summary_path: Path | None = None
    chaos: bool = False
    chaos_interval_s: float = 20.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: the spec's metricsPort; 0: any free port
    progress: ProgressReporter = field(default_factory=ProgressReporter)
    step_group_timeout_s: float = 900.0  # bound on waiting for one step's rollouts
    # relative eval dataset paths and external eval classes are found here: the manifest's directory
    # locally, the snapshot volume in a pod
    manifest_dir: Path | None = None
    eval_engine_python: str | None = None  # interpreter (or wrapper) of local eval engines; None: this one
    resume: bool = False  # start from the newest complete checkpoint (spec.checkpoint)
    record_batches: Path | None = None  # write each step's training batch here (step_<N>.json), to replay it
    # Told (with the exception) as a failure or a cancel starts the run's cleanup, before any of it:
    # `rlfleet run` bounds the stop from then on, as it does from a signal.
    stopping: Callable[[BaseException], None] | None = None
    # Awaited with the RunError that ends the run, as its cleanup starts and before any of it: in a pod the
    # failure is written on the run first, so a cleanup the stop bound cuts short cannot lose it.
    failing: Callable[[RunError], Awaitable[None]] | None = None


def run_error_of(exc: BaseException) -> RunError | None:
    """The RunError that ends a run, also when a task group raised it; None for anything else."""
    error = first_error(exc)
    return error if isinstance(error, RunError) else None


class RunStack(contextlib.AsyncExitStack):
    """The run's cleanup (engines, routers, trainer ranks, ...). When an exception starts it, before the
    first callback runs: `stopping(exception)` is called, then `failing(run_error)` awaited when it is a
    RunError (an error of `failing` is logged; the cleanup runs whatever it did)."""

    def __init__(self, stopping: Callable[[BaseException], None] | None = None,
                 failing: Callable[[RunError], Awaitable[None]] | None = None):
        super().__init__()
        self._stopping = stopping
        self._failing = failing

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        if exc is not None and self._stopping is not None:
            self._stopping(exc)
        try:
            if exc is not None and self._failing is not None and (error := run_error_of(exc)) is not None:
                try:
                    await self._failing(error)
                except Exception:  # telling of the failure must not keep the cleanup from running
                    log.exception("could not tell of the run's failure before its cleanup")
        finally:
            cleaned = await super().__aexit__(exc_type, exc, tb)
        return cleaned


def resolve_model_dir(model_path: str) -> Path:
    """A local model directory for modelPath: tiny:// models are generated into the cache."""
    tiny = parse_tiny_model(model_path)
    if tiny is not None:
        from rlfleet.trainer.tiny import ensure_tiny_model

        return ensure_tiny_model(CACHE_DIR / "models" / tiny.cache_name, seed=tiny.seed, arch=tiny.arch)
    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise RunFailed("ModelNotFound", f"modelPath {model_path!r} is not a Hugging Face model directory "
                                         "(locally, use a directory or tiny://llama)")
    return path


@dataclass(frozen=True)
class PendingSnapshot:
    """A step's weight snapshot and what completes once it is written (and valid)."""

    step: int
    path: Path
    future: asyncio.Future[Any]


def first_start_bound(rollout: RolloutTemplateSpec) -> float:
    """Seconds the run's first start waits for every engine: an engine may take its whole startup bound to
    become healthy (loading a large model), so never less than that; waitAllAlive bounds the waits of later
    syncs, where engines already loaded once."""
    return max(rollout.health.startup_timeout_seconds, rollout.recovery.wait_all_alive_timeout_seconds)


def snapshot_dir(root: Path, step: int) -> Path:
    return root / f"step_{step}"


def export_step(trainer, out_dir: Path, step: int, keep_tensors: bool) -> tuple[Path, Any]:
    """Write the step's snapshot; with keep_tensors also return its tensors (HF names, CPU), which a
    broadcast sync sends and the checksum verification hashes (one copy off the trainer serves all)."""
    if not keep_tensors:
        return trainer.export_hf(out_dir, step), None
    state = trainer.state_for_export()
    state = ExportState(step=step, tensors=state.tensors, config=state.config, source_dir=state.source_dir)
    return write_hf_snapshot(state, out_dir), state.tensors


def sync_record(result: WeightSyncResult) -> dict[str, Any]:
    """What the summary keeps of one weight sync."""
    checks = [e.checksum for e in result.engines if e.checksum is not None]
    return {
        "mode": result.mode, "seconds": round(result.total_s, 3),
        "phases": {k: round(v, 3) for k, v in result.phases.items()},
        "bytes_broadcast": result.bytes_broadcast, "fallback": result.fallback_reason,
        "checksums": {r: checks.count(r) for r in sorted(set(checks))},
        "scaled_away": list(result.scaled_away),
    }


def record_batch(directory: Path, step: int, samples, stats: dict) -> None:
    """`<directory>/step_<N>.json`: the samples step N trained on, its loss and the trainer's other
    figures (gradient norm, ...), to replay the step."""
    directory.mkdir(parents=True, exist_ok=True)
    data = {"step": step, "loss": stats["loss"], "stats": dict(stats),
            "samples": [dataclasses.asdict(s) for s in samples]}
    tmp = directory / f".step_{step}.json.tmp"
    tmp.write_text(json.dumps(data))
    tmp.replace(directory / f"step_{step}.json")


class RunLoop:
    """The platform-independent part of a run; subclasses start the fleets and report progress.

    Hooks: `_start_rollout` (must set `backend`, `fleet`, return the router URL), `_eval_fleet_factory`
    (posture fleet), `_after_step` (after each step's sync), `_engine_logs` (watchdog diagnostics),
    `_background` (extra tasks beside the watchdog), `_retire_snapshot`.
    """

    def __init__(self, run: TrainingRun, options: RunOptions, *, snapshots: Path, scratch_volume: bool = False):
        self.run = run
        self.spec = run.spec
        assert run.metadata.name is not None, "a TrainingRun that runs has a name"
        self.name: str = run.metadata.name
        self.options = options
        self.progress = options.progress
        self.state = ProgressState(steps=self.spec.trainer.steps, engines_total=self.spec.rollout.replicas)
        self.summary = RunSummary(steps_planned=self.spec.trainer.steps)
        self.snapshots = Path(snapshots)
        self.scratch_volume = scratch_volume  # removed when the run ends
        self.current_snapshot: Path | None = None
        self.backend: FleetBackend | None = None
        self.fleet: FleetRuntime | None = None
        self.evaluation: RunEvaluation | None = None
        self.heat: HeatGuardTask | None = None  # spec.heatGuard.enabled
        self._client: RolloutClient | None = None
        self._producer_running: RolloutProducer | None = None
        self.api_key: str | None = None  # the fleets' key (subclasses set it): every call to them sends it
        # Checkpoints (spec.checkpoint) and where a resumed run starts: the engines launch on the
        # checkpoint's weights, version "<step>" (a fresh run: step_0, "0").
        self.checkpoints: RunCheckpoints | None = None
        self.resumed: ResumePoint | None = None
        self.start_step = 0
        self.launch_snapshot: Path | None = None
        self._kept_snapshots: list[Path] = []  # the step snapshots still on the volume, oldest first
        # The last step's snapshot, until it is written and what replacements start from (_settle_snapshot).
        self._pending_snapshot: PendingSnapshot | None = None
        self._snapshot_lock = asyncio.Lock()
        self.prompts_drawn = 0
        self._recreated_before = 0
        self._checkpoints_before: list[dict] = []
        self._started = time.monotonic()
        self._step_in_progress = 0  # what events are recorded at
        self.trackers: RunTrackers | None = None  # spec.tracking
        self._startup_stages: dict[int, str] = {}  # slot -> starting/loading, from its log (terminal view)

    # --- the run -----------------------------------------------------------------------------

    async def execute(self) -> RunSummary:
        started = self._started = time.monotonic()
        try:
            await self._execute_as_run_failed()
        except Exception as exc:  # not a RunError: a bug, raised as it is; the summary says it too
            if self.summary.failure is None:
                error = first_error(exc)
                self.summary.failure = f"{type(error).__name__}: {error}"
            raise
        finally:
            if self.scratch_volume:
                await asyncio.to_thread(shutil.rmtree, self.snapshots, True)
            self.summary.wall_seconds = time.monotonic() - started
            self._count_recoveries()
            if self._client is not None:
                self.summary.rollout_attempts = dict(self._client.attempts)
                self.summary.rollout_continuations = self._client.continued.as_dict()
            if self.options.summary_path is not None:
                await asyncio.to_thread(self.summary.write, self.options.summary_path)
            self.progress.close()
        return self.summary

    async def _execute_as_run_failed(self) -> None:
        """The run; any RunError that ends it is raised as a RunFailed, recorded in the summary."""
        try:
            await self._execute()
        except* RunFailed as group:
            exc = group.exceptions[0]
            assert isinstance(exc, RunFailed), "a RunFailed is raised at most one task group deep"
            self.summary.failure = f"{exc.reason}: {exc.message}"
            raise exc from None
        except* RunError as group:
            error = first_error(group)  # also when raised inside a nested task group
            assert isinstance(error, RunError), "except* RunError holds only RunErrors"
            self.summary.failure = f"{error.reason}: {error}"
            raise RunFailed(error.reason, str(error)) from None

    async def _execute(self) -> None:
        spec = self.spec
        opts = self.options
        # Before anything starts: a heat guard that could not read the engines' GPUs is refused.
        check_heat_guard(spec.heat_guard, self._engine_placement())
        opts.run_dir.mkdir(parents=True, exist_ok=True)
        self.snapshots.mkdir(parents=True, exist_ok=True)
        async with RunStack(opts.stopping, opts.failing) as stack:
            server = MetricsServer(opts.metrics_host,
                                   spec.metrics_port if opts.metrics_port is None else opts.metrics_port)
            url = await server.start()
            stack.push_async_callback(server.stop)
            self.progress.event(f"run {self.name}: metrics at {url}, logs in {opts.run_dir}")
            await self._open_trackers(stack)
            if self.progress.tty:
                ticker = asyncio.get_running_loop().create_task(self._tick(), name="status-line")
                stack.callback(ticker.cancel)

            self._phase("loading the trainer")
            model_dir = await asyncio.to_thread(resolve_model_dir, spec.model_path)
            try:
                trainer = await asyncio.to_thread(build_run_trainer, spec, model_dir)
            except (ValueError, OSError) as exc:  # before any engine starts: a reason, not a traceback
                raise RunFailed("TrainerSetupFailed",
                                f"{spec.trainer.backend} trainer on {spec.model_path}: {exc}") from None
            if isinstance(trainer, LeadingTrainer):  # rank 0 of several: the other ranks stop when the run does
                stack.push_async_callback(asyncio.to_thread, trainer.close)
            self.state.trainer = ranks_label(spec)
            self.progress.event(describe_trainer(spec))
            if spec.checkpoint is not None:
                await self._open_checkpoints(trainer, stack)
            self.current_snapshot = await asyncio.to_thread(
                trainer.export_hf, snapshot_dir(self.snapshots, self.start_step), self.start_step)
            self.launch_snapshot = self.current_snapshot

            # --- eval: checked first; the eval fleet starts beside the rollout engines, nothing waits for it ---
            if spec.eval is not None:
                self.evaluation = RunEvaluation(self.name, spec, volume=self.snapshots, manifest_dir=opts.manifest_dir,
                                                start_eval_fleet=self._eval_fleet_factory(), on_point=self._on_eval)
                stack.push_async_callback(self._close_evaluation)
                await self.evaluation.launch(self.current_snapshot)  # EvalSetupError: reason EvalInvalid
            # --- end eval ---
            router_url = await self._start_rollout(stack)
            assert self.backend is not None and self.fleet is not None
            stack.push_async_callback(self.fleet.stop)
            self.backend.subscribe(self._on_death)
            self.backend.subscribe_resize(self._on_resize)
            await self.fleet.start()
            await self._bring_up(first_start_bound(spec.rollout))
            self._engines_changed()
            self.progress.event(f"{self._ready_engines()} engines serving weights v{self.launch_version} "
                                f"behind {router_url}", self.state)

            session = await stack.enter_async_context(client_session(self.api_key,
                                                                     connector=fleet_connector()))
            watchdog = WatchdogTask(spec.watchdog, recover=self._recover_for_watchdog, can_serve=self._can_serve,
                                    engine_logs=self._engine_logs, on_strike=self._on_watchdog_strike)
            fleet = self.fleet

            async def to_router(payload, timeout_s: float) -> dict:  # follows the router if it moves
                return await post_generate(session, fleet.router_url.rstrip("/") + "/generate", payload, timeout_s)

            async def router_answers(timeout_s: float) -> bool:  # the open circuit's probe, same router
                return await probe_health(session, fleet.router_url.rstrip("/") + "/health", timeout_s)

            async def stream_from_router(payload, timeout_s: float, on_chunk) -> dict:  # continuation's path
                return await stream_generate(session, fleet.router_url.rstrip("/") + "/generate", payload,
                                             timeout_s, on_chunk, connect_timeout_s=CONNECT_TIMEOUT_S)

            client = RolloutClient(
                router_url, session, on_failure=watchdog.record_failure, transport=to_router, probe=router_answers,
                policy=RetryPolicy(max_attempts=spec.rollout.max_retries + 1,
                                   deadline_s=spec.rollout.request_timeout_seconds),
                rng=random.Random(spec.trainer.seed),
                continuation=spec.rollout.continuation, stream=stream_from_router,
            )
            self._client = client
            producer = await self._producer(client, trainer)
            producer.start()
            self._producer_running = producer
            stack.push_async_callback(producer.stop)
            if self.evaluation is not None:  # eval
                self.evaluation.attach(trainer=trainer, rollout=self.fleet, producer=producer, session=session,
                                       stop_token_ids=producer.sampling.stop_token_ids)
                if self.resumed is not None:  # the points settled before the checkpoint; its pending ones again
                    await self.evaluation.restore(self.resumed.eval_points, self.resumed.eval_pending,
                                                  current_step=self.start_step)
            # --- heat guard: pauses hot engines; the monitor holds their probes meanwhile
            if spec.heat_guard.enabled:
                self.heat = heat_guard_for(self.fleet, spec.heat_guard, placement=self._engine_placement(),
                                           on_event=self._on_heat_event)

            stack.push_async_callback(self._drain_snapshot)
            async with asyncio.TaskGroup() as tasks:
                background = []
                if spec.watchdog.enabled:  # off: failures are still counted (metrics), nothing acts on them
                    background.append(tasks.create_task(watchdog.run(), name="watchdog"))
                if self.heat is not None:  # cancelled with the others: it resumes what it paused
                    background.append(tasks.create_task(self.heat.run(), name="heat-guard"))
                background += [tasks.create_task(coro) for coro in self._background()]
                try:
                    await self._train(trainer, producer)
                finally:
                    for task in background:
                        task.cancel()
            self._phase("done")
            self.progress.event(f"run {self.name} finished {len(self.summary.steps)} steps", self.state)

    async def _producer(self, client: RolloutClient, trainer) -> RolloutProducer:
        from rlfleet.trainer.tasks import load_reward_fn, load_task

        t = self.spec.trainer
        # Loading a task or a reward function imports user code, a tokenizer reads files: off the loop.
        task = await asyncio.to_thread(load_task, t.task)
        reward_fn = await asyncio.to_thread(load_reward_fn, t.reward_function) if t.reward_function else task.reward
        problems = iter(task.problems(t.seed))
        drawn_before = self.prompts_drawn
        if drawn_before:  # resumed: the prompts drawn before the checkpoint are not drawn again
            problems = itertools.islice(problems, drawn_before, None)

        def prompts():
            for p in problems:
                self.prompts_drawn += 1
                yield p.prompt, p.answer

        tokenizer: Any = trainer.tokenizer if hasattr(trainer, "tokenizer") else None
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, trainer.model_dir)
        return RolloutProducer(
            client, prompts(), reward_fn,
            lambda text: tokenizer.encode(text, add_special_tokens=False),
            samples_per_prompt=t.samples_per_prompt,
            sampling=SamplingSettings.for_trainer(t, tokenizer.eos_token_id),
            concurrency=self._groups_in_flight(self.backend.replicas if self.backend else self.spec.rollout.replicas),
            queue_groups=2 * t.prompts_per_step, run_id=self.name, prompts_before=drawn_before,
        )

    async def _train(self, trainer, producer: RolloutProducer) -> None:
        t = self.spec.trainer
        policy = grpo.StalenessPolicy(t.max_staleness, by=t.staleness_by)
        if self.evaluation is not None and self.start_step == 0:  # eval: the initial model (evalBeforeTrain)
            await self.evaluation.after_step(0)
        self.state.training_since, self.state.first_step = time.monotonic(), self.start_step
        for step in range(self.start_step + 1, t.steps + 1):
            self._step_in_progress = step
            phases: dict[str, float] = {}
            clock = asyncio.get_running_loop().time
            step_started = time.monotonic()
            loop_started = clock()  # the heat guard's clock
            self._phase("rollout")
            groups, stale = await self._collect_groups(producer, trainer.step, policy)
            batch = grpo.assemble_batch(groups, current_step=trainer.step, policy=policy)
            staleness = staleness_of([s.weight_version for s in batch.samples], trainer.step)
            phases["rollout_wait"] = clock() - loop_started
            self._phase("train")
            began = clock()
            stats = await asyncio.to_thread(trainer.train_step, list(batch.samples))
            if self.options.record_batches is not None:
                await asyncio.to_thread(record_batch, self.options.record_batches, step, batch.samples, stats)
            phases["train"] = clock() - began
            self._phase("export")
            began = clock()
            ws = self.spec.weight_sync
            assert self.fleet is not None, "the rollout fleet starts before training"
            if ws.mode == "broadcast":
                result, began = await self._broadcast_step(trainer, step, phases)
            else:
                # The tensors are kept (a copy of the model) only for a verification that can take place.
                verifies = self.fleet.weights is not None and self.fleet.weights.verifies
                path, tensors = await asyncio.to_thread(export_step, trainer, snapshot_dir(self.snapshots, step), step,
                                                        verifies)
                phases["export"] = clock() - began
                self._phase("weight sync")
                began = clock()
                result = await self.fleet.sync_weights(path, step, tensors=tensors)
                del tensors
                self._pending_snapshot = PendingSnapshot(step, path, resolved(path))
            await self._after_sync(step, stats)
            await self._settle_snapshot(wait=False)  # written already (disk mode), or later (broadcast)
            phases["weight_sync"] = clock() - began
            if self.evaluation is not None:  # eval: waits only to copy the weights (or on backpressure)
                began = clock()
                await self.evaluation.after_step(step)
                phases["eval_held"] = clock() - began
            seconds = time.monotonic() - step_started
            heat_paused = (self.heat is not None and self.heat.mark_step(
                step, loop_started, clock()).overlapped_pause)
            versions = [s.weight_version for s in batch.samples]
            for slot in result.recovered_slots:
                self._event("engine_recreated", slot=str(slot), detail="recreated before the weight sync")
            record = StepRecord(
                step, stats["reward_mean"], versions, seconds, len(batch.samples),
                engine_versions={e.slot: e.version for e in result.synced if e.version is not None},
                recovered_slots=list(result.recovered_slots), heat_paused=heat_paused, sync=sync_record(result),
                loss=stats["loss"], reward_std=reward_std([s.reward for s in batch.samples]),
                kl_ref=stats.get("kl_ref"), clip_fraction=stats.get("clip_fraction"),
                grad_norm=stats.get("grad_norm"),
                response_length_mean=sum(len(s.response_ids) for s in batch.samples) / max(1, len(batch.samples)),
                tokens=int(stats.get("tokens", 0)), staleness=staleness, stale_groups_dropped=stale,
                samples_per_s=len(batch.samples) / max(seconds, 1e-9),
                tokens_per_s=float(stats.get("tokens", 0)) / max(seconds, 1e-9), phases=phases,
            )
            if self.checkpoints is not None and self.checkpoints.is_checkpoint_step(step):
                self._phase("checkpoint")
                began = clock()
                record.phases["checkpoint"] = 0.0  # the checkpoint carries the record: its own time comes after
                self.summary.steps.append(record)
                await self._checkpoint(trainer, step)
                record.phases["checkpoint"] = clock() - began
            else:
                self.summary.steps.append(record)
            record.ended_at = time.monotonic() - self._started
            for phase, phase_s in record.phases.items():
                metrics.RUN_STEP_PHASE_DURATION.labels(run=self.name, phase=phase).observe(phase_s)
            metrics.RUN_STEP.labels(run=self.name).set(step)
            metrics.RUN_REWARD_MEAN.labels(run=self.name).set(stats["reward_mean"])
            self.state.step = step
            self.state.reward = stats["reward_mean"]
            self.state.weight_version = str(step)
            self.state.samples_per_s = len(batch.samples) / max(seconds, 1e-9)
            self._engines_changed()
            self.progress.event(
                f"step {step}/{t.steps} reward {stats['reward_mean']:.3f} loss {stats['loss']:.4f} "
                + (f"kl_ref {stats['kl_ref']:.4f} " if "kl_ref" in stats else "") +
                f"versions {sorted(set(versions))} stale groups dropped {stale} "
                f"sync {result.outcome} {result.mode} {result.total_s:.2f} s step {seconds:.1f} s "
                f"({format_phases(record.phases)})"
                + (" (fell back to disk)" if result.fallback_reason else "")
                + (" (overlapped a heat pause)" if heat_paused else ""),
                self.state,
            )
            self._track_step(record)
        await self._settle_snapshot(wait=True)  # the last step's snapshot is written before the run ends
        if self.checkpoints is not None:
            await self.checkpoints.wait()
        if self.evaluation is not None:  # eval: every point settles before the run ends
            self._phase("eval drain")
            await self.evaluation.finish()

    async def _broadcast_step(self, trainer, step: int, phases: dict[str, float]) -> tuple[WeightSyncResult, float]:
        """Broadcast the step's weights, then write its snapshot (the next fallback, and what replacements
        start from). The sync ends when every engine serves them; the snapshot is written beside the
        next step's rollouts and training, and waited for (`snapshot_wait`) only before the next export
        reuses the buffer it is written from. `phases["export"]`: the copy off the device; returns the
        loop time the sync began (the rest is the weight sync's)."""
        assert self.fleet is not None, "the rollout fleet starts before training"
        clock = asyncio.get_running_loop().time
        waited = await self._settle_snapshot(wait=True)
        if waited is not None:
            phases["snapshot_wait"] = waited
        began = clock()
        # Off the device, straight into the broadcast's shared buffer once its group exists: the one copy
        # the broadcast, the snapshot writer and the checksum verification all read.
        state = await asyncio.to_thread(trainer.state_for_export, self.fleet.export_views())
        state = ExportState(step=step, tensors=state.tensors, config=state.config, source_dir=state.source_dir)
        phases["export"] = clock() - began
        path = snapshot_dir(self.snapshots, step)
        self._phase("weight sync")
        began = clock()
        result = await self.fleet.sync_weights(path, step, tensors=state.tensors,
                                               write_snapshot=lambda: asyncio.to_thread(write_hf_snapshot, state, path))
        # The sync handed over the snapshot's write, or (a fallback) wrote it already.
        self._pending_snapshot = PendingSnapshot(step, path, resolved(path) if result.snapshot is None
                                                 else result.snapshot)
        return result, began

    async def _settle_snapshot(self, *, wait: bool) -> float | None:
        """The step snapshot still being written beside training: once written (waited for if `wait`),
        it is what replacements start from (`_snapshot_ready`). Returns the seconds waited (None: no
        snapshot was pending, or it is still being written and `wait` is false); a snapshot that could
        not be written fails the run, naming it."""
        async with self._snapshot_lock:  # the loop and the watchdog's recovery: one settles it
            pending = self._pending_snapshot
            if pending is None or not (wait or pending.future.done()):
                return None
            clock = asyncio.get_running_loop().time
            began = clock()
            await asyncio.wait([pending.future])  # a waiter cancelled here leaves it to the next one
            waited = clock() - began
            try:
                pending.future.result()
            except OSError as exc:  # left pending: whoever settles it next (the loop, after a recovery) fails too
                raise RunFailed("SnapshotWriteFailed", f"the weight snapshot of step {pending.step} "
                                                       f"({pending.path}) could not be written: {exc}") from exc
            self._pending_snapshot = None
            await self._snapshot_ready(pending.step, pending.path)
            return waited

    async def _drain_snapshot(self) -> None:
        """A run that ends with a step snapshot still being written waits for its thread (which ends by
        itself) before the volume is cleaned up; its error, if any, is not the run's."""
        if self._pending_snapshot is not None:
            await settle(self._pending_snapshot.future)

    async def _snapshot_ready(self, step: int, path: Path) -> None:
        """`path` is written and valid: replacements start from it; older snapshots past
        `keepSnapshots` go."""
        self.current_snapshot = path
        await self._pin_snapshot(step, path)
        await self._retire_snapshots(path)

    async def _collect_groups(self, producer: RolloutProducer, current_step: int, policy) -> tuple[list, int]:
        wanted = self.spec.trainer.prompts_per_step
        groups: list = []
        stale = 0
        deadline = asyncio.get_running_loop().time() + self.options.step_group_timeout_s
        while len(groups) < wanted:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise RunFailed("RolloutTimeout", f"only {len(groups)} of {wanted} groups arrived within "
                                                  f"{self.options.step_group_timeout_s:g} s")
            try:
                async with asyncio.timeout(remaining):
                    group = await producer.next_group()
            except TimeoutError:
                continue  # the deadline check above fails the step
            if all(policy.is_fresh(s, current_step) for s in group):
                groups.append(group)
            else:
                stale += 1
        return groups, stale

    # --- recovery, watchdog and chaos ---------------------------------------------------------

    async def _recover_for_watchdog(self) -> None:
        await self._settle_snapshot(wait=True)  # the newest weights, once written
        assert self.fleet is not None and self.current_snapshot is not None
        step = int(self.current_snapshot.name.removeprefix("step_"))
        await self.fleet.sync_weights(self.current_snapshot, step)

    async def _can_serve(self) -> bool:
        """The serving path, end to end: a one-token generation through the rollout router answers
        (retried for up to one check interval, so a router coming back meanwhile counts)."""
        assert self.fleet is not None
        error = await self.fleet.serves_through_router(within_s=float(self.spec.watchdog.check_interval_seconds))
        if error is not None:
            log.error("watchdog: no generation through the rollout router: %s", error)
            self.progress.event(f"watchdog: the rollout router does not serve: {error[:200]}", self.state)
            return False
        return True

    def _on_router_event(self, fleet: str, message: str) -> None:
        """A fleet's router exited or was restarted."""
        self.summary.router_events.append(f"{fleet}: {message}")
        self._event("router_event", slot=fleet, detail=message)
        self.progress.event(f"fleet {fleet}: {message}", self.state)

    def _router_logs(self) -> dict[str, list[str]]:
        """The routers' last log lines, for the watchdog's failure message (where they can be read)."""
        return {}

    # --- platform hooks ------------------------------------------------------------------------

    async def _start_rollout(self, stack: contextlib.AsyncExitStack) -> str:
        """Start (or attach to) the rollout fleet and its router; set self.backend and self.fleet (not
        started). Returns the router URL. Cleanup of what it started goes on `stack`."""
        raise NotImplementedError

    def _eval_fleet_factory(self):
        """`async (launch_model) -> (PinnedEvalFleet, router or None)` for posture fleet."""
        raise NotImplementedError

    async def _bring_up(self, timeout_s: float) -> None:
        """The engines serve the launch weights (version `launch_version`): admit them to the router."""
        assert self.fleet is not None
        await self.fleet.bring_up(self.launch_version, timeout=timeout_s)

    async def _after_sync(self, step: int, stats: dict) -> None:
        """Every engine serves version `step` now."""

    async def _pin_snapshot(self, step: int, snapshot: Path) -> None:
        """`snapshot` (version `step`) is written: where this platform's replacement engines start from."""

    def _background(self) -> list:
        """Extra coroutines to run beside the training loop (cancelled when it ends)."""
        return []

    def _rollout_gpu_bases(self) -> tuple[int, ...]:
        """Each rollout engine slot's first GPU where this platform placed them; () where a pod has its own."""
        return ()

    def _engine_placement(self) -> EnginePlacement:
        """Where the rollout engines run, so the heat guard reads their GPUs: by default processes on this
        machine, on `_rollout_gpu_bases()`, counted among the GPUs the engines' CUDA_VISIBLE_DEVICES shows
        (what they inherit, not the trainer's spec.trainer.env; or their own spec.rollout.engine.env)."""
        engine_env = literal_env(self.spec.rollout.engine.env)
        visible = engine_visible_devices(outer_environment(os.environ), engine_env)
        return LocalEngines(self._rollout_gpu_bases(), visible_devices=visible)

    def _engine_logs(self) -> dict[str, list[str]]:
        """The engines' (and routers') last log lines, for the watchdog's failure message."""
        assert self.backend is not None
        logs: dict[str, list[str]] = {}
        for e in self.backend.engines():
            if e.log_path:
                logs[f"slot {e.slot}"] = tail_file(Path(e.log_path), 8)
            elif e.last_failure:
                logs[f"slot {e.slot}"] = e.last_failure.splitlines()[-8:]
        logs.update(self._router_logs())
        return logs

    def _on_heat_event(self, event: HeatEvent) -> None:
        temp = "" if event.temp_c is None else f" at {event.temp_c:.0f} C"
        self._event(f"heat_{event.action.value}", slot=event.slot, detail=f"{event.reason}{temp}")
        self.progress.event(f"heat guard: {event.action.value} {event.slot} ({event.reason}{temp})", self.state)

    def _groups_in_flight(self, engines: int) -> int:
        t = self.spec.trainer
        return groups_in_flight(requests_per_engine=self.spec.rollout.concurrency_per_engine, engines=engines,
                                samples_per_prompt=t.samples_per_prompt, prompts_per_step=t.prompts_per_step)

    def _on_resize(self, event: FleetResize) -> None:
        """The rollout fleet was scaled (the run's spec.rollout.replicas changed): as many groups in flight
        as the engines take; a new engine serves once the next sync has given it the current weights."""
        if self._producer_running is not None and event.replicas > 0:
            self._producer_running.set_concurrency(self._groups_in_flight(event.replicas))
        self._event("fleet_resized", detail=f"{event.replicas_before} -> {event.replicas} engines, "
                                            f"minReadyEngines {event.min_ready}")
        self._engines_changed()
        added = "; each new engine gets the current weights at the first sync after it is Ready" \
            if event.replicas > event.replicas_before else ""
        self.progress.event(f"rollout fleet scaled from {event.replicas_before} to {event.replicas} engines{added}",
                            self.state)

    def _on_death(self, event: DeathEvent) -> None:
        self.summary.engines_marked_dead += 1
        self._event("engine_dead", slot=str(event.slot), detail=f"{event.cause}: {event.reason[:200]}")
        self._engines_changed()
        self.progress.event(f"engine slot {event.slot} marked dead ({event.cause}): {event.reason[:200]}", self.state)

    # --- bookkeeping ---------------------------------------------------------------------------

    def _event(self, kind: str, *, slot: str | None = None, detail: str = "") -> None:
        """One entry of the summary's event log, at the step in progress."""
        self.summary.events.append(RunEvent(kind=kind, step=self._step_in_progress, slot=slot, detail=detail,
                                            at=round(time.monotonic() - self._started, 3)))

    def _on_watchdog_strike(self, strikes_in_a_row: int, failures: int) -> None:
        self._event("watchdog_strike", detail=f"{strikes_in_a_row} in a row, {failures} failed requests in the window")

    def _track_step(self, record: StepRecord) -> None:
        """Hand the step's record to the trackers (spec.tracking); they never hold the loop."""
        if self.trackers is not None:
            self.trackers.step(record_to_dict(record), self.summary.events)

    def _tracker_dir(self, relative: str) -> Path:
        """Where a tracker's files go (spec.tracking.tensorboard.logDir, W&B's run files):
        `<relative>/<run>` on the snapshot volume."""
        return self.snapshots / relative / self.name

    async def _open_trackers(self, stack: contextlib.AsyncExitStack) -> None:
        try:
            sinks = build_sinks(self.run, tracker_dir=self._tracker_dir,
                                on_warning=lambda text: self.progress.event(text, self.state))
        except TrackerUnavailable as exc:
            raise RunFailed("TrackerUnavailable", str(exc)) from None
        if not sinks:
            return
        self.trackers = RunTrackers(sinks)
        self.trackers.start()
        names = ", ".join(sink.tracker.name for sink in sinks)
        self.progress.event(f"tracking to {names}")

        async def close(exc_type, exc, tb) -> None:
            assert self.trackers is not None
            status = "FINISHED" if exc_type is None else "KILLED" if exc_type is asyncio.CancelledError else "FAILED"
            self.summary.tracking = await self.trackers.close(status)

        stack.push_async_exit(close)

    def _ready_engines(self) -> int:
        if self.backend is None:
            return 0
        return sum(1 for e in self.backend.engines() if e.state is EngineState.ALIVE)

    def _engines_changed(self) -> None:
        self.state.engines_ready = self._ready_engines()
        if self.backend is not None:
            self.state.engines_total = self.backend.replicas
        self._label_engines()
        self.progress.update(self.state)

    def _phase(self, phase: str) -> None:
        self.state.set_phase(phase)
        self.progress.update(self.state)

    def _label_engines(self) -> None:
        """Each engine's label on the status line, from its state, its start-up stage and the router's pins."""
        if self.backend is None:
            return
        membership = self.fleet.membership if self.fleet is not None else None
        pinned: dict[str, str] = membership.pinned() if membership is not None else {}
        self.state.engines = {
            str(e.slot): engine_label(e.state.value, self._startup_stages.get(e.slot),
                                      pinned.get(e.url) if e.url else None)
            for e in self.backend.engines()
        }

    async def _tick(self) -> None:
        """On a terminal: redraw the status line every second (elapsed times move; engines that start
        are read from their logs, in a thread)."""
        while True:
            await asyncio.sleep(1.0)
            try:
                if self.backend is not None:
                    starting = [e for e in self.backend.engines() if e.state is EngineState.STARTING and e.log_path]
                    for e in starting:
                        assert e.log_path is not None
                        tail = await asyncio.to_thread(tail_file, Path(e.log_path), 60)
                        self._startup_stages[e.slot] = startup_stage(tail)
                    self._label_engines()
                self.progress.update(self.state)
            except Exception:  # the view never fails the run
                log.debug("status line refresh failed", exc_info=True)

    def _count_recoveries(self) -> None:
        if self.backend is not None:
            self.summary.engines_recreated = self._recreated_before + sum(e.restarts for e in self.backend.engines())
        if self.checkpoints is not None:
            self.summary.checkpoints = [*self._checkpoints_before, *self.checkpoints.written]

    # --- checkpoints ---------------------------------------------------------------------------

    @property
    def launch_version(self) -> str:
        return str(self.start_step)

    def _checkpoint_root(self) -> Path:
        """Where spec.checkpoint.path is: on the run's snapshot volume (platforms may choose otherwise)."""
        assert self.spec.checkpoint is not None
        return self.snapshots / self.spec.checkpoint.path

    def _identity(self) -> ckpt.Identity:
        t = self.spec.trainer
        return ckpt.Identity(run=self.name, model_path=self.spec.model_path, backend=t.backend,
                             world_size=t.world_size, tensor_parallel=t.tensor_parallel_size,
                             pipeline_parallel=t.pipeline_parallel_size)

    async def _open_checkpoints(self, trainer, stack: contextlib.AsyncExitStack) -> None:
        assert self.spec.checkpoint is not None
        self.checkpoints = RunCheckpoints(self.name, self.spec.checkpoint, self._checkpoint_root(), self._identity(),
                                          on_event=lambda message: self.progress.event(message, self.state))
        stack.push_async_callback(self.checkpoints.close)
        if not self.options.resume:
            await self.checkpoints.refuse_leftovers()
            return
        self._phase("resuming")
        self.resumed = await self.checkpoints.resume(trainer)
        if self.resumed is None:
            return
        self.start_step = self.resumed.step
        self.prompts_drawn = self.resumed.prompts_drawn
        self._recreated_before = restore_summary(self.summary, self.resumed.summary)
        self._checkpoints_before = list(self.summary.checkpoints)
        self.summary.resumed_from.append(self.start_step)
        if self.summary.steps:
            self.state.reward = self.summary.steps[-1].reward_mean
        self.state.step = self.start_step
        self.state.weight_version = self.launch_version
        metrics.RUN_STEP.labels(run=self.name).set(self.start_step)

    async def _checkpoint(self, trainer, step: int) -> None:
        assert self.checkpoints is not None
        self._count_recoveries()
        evaluation = self.evaluation
        dispatcher = evaluation.dispatcher if evaluation is not None else None

        def state(held: float) -> dict:
            summary = summary_state(self.summary, self.summary.engines_recreated)
            # This checkpoint as a resumed run will see it: how long it held the loop (its write is not done).
            summary["checkpoints"].append({"step": step, "loop_held_seconds": round(held, 6), "write_seconds": None})
            return run_state(run=self.name, step=step, prompts_drawn=self.prompts_drawn,
                             eval_points=list(dispatcher.points) if dispatcher else [],
                             eval_pending=dispatcher.pending_steps if dispatcher else [], summary=summary)

        await self.checkpoints.save(trainer, step, state)

    # --- eval ------------------------------------------------------------------------------------

    def _on_eval(self, point: EvalPoint) -> None:
        assert self.evaluation is not None
        self.summary.eval = self.evaluation.summary_points()
        if self.trackers is not None:
            self.trackers.eval(point.to_summary())
        what = (f"skipped {point.skipped}" + (f": {point.detail[:200]}" if point.detail else "") if point.skipped
                else " ".join(f"{k}={v:.3f}" for k, v in sorted(point.scores.items())) +
                f" (v{point.weight_version}, {point.seconds or 0:.1f} s)")
        self.progress.event(f"eval @{point.step} [{point.posture}] {what}", self.state)

    async def _close_evaluation(self) -> None:
        assert self.evaluation is not None
        try:
            await self.evaluation.close()
        finally:
            self.summary.eval = self.evaluation.summary_points()
            self.summary.eval_snapshots_left = await asyncio.to_thread(self.evaluation.snapshots_left)

    async def _retire_snapshots(self, newest: Path) -> None:
        """`weightSync.keepSnapshots` newest step snapshots stay on the volume (the one engines serve
        included); older ones go."""
        launch = frozenset({self.launch_snapshot} if self.launch_snapshot is not None else ())
        self._kept_snapshots, retired = snapshots_to_retire([*self._kept_snapshots, newest],
                                                            self.spec.weight_sync.keep_snapshots, never=launch)
        for path in retired:
            await self._retire_snapshot(path)

    async def _retire_snapshot(self, path: Path | None) -> None:
        """Weight snapshots are needed until every engine runs the next one; the launch weights (step_0, or
        a resumed run's checkpoint step) stay. Removed in a thread: a full model on a network volume takes
        a while."""
        if path is not None and path.name != "step_0" and path != self.launch_snapshot:
            await asyncio.to_thread(shutil.rmtree, path, ignore_errors=True)
