"""`rlfleet run FILE`: run a TrainingRun on this machine with local processes.

`rlfleet run --kubernetes --namespace NS --training-run NAME` runs it inside the cluster instead: the
operator's trainer pod runs this, driving the fleets the operator created (see orchestrator/run/kubernetes.py).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rlfleet.crds.loader import FieldError, ManifestError, load_training_run, local_run_errors, validate_object
from rlfleet.crds.models import TrainingRun
from rlfleet.crds.specs import literal_env
from rlfleet.errors import RunError
from rlfleet.observability.report import report_path_for, write_report
from rlfleet.orchestrator.run import tracking
from rlfleet.orchestrator.run.loop import RunFailed, RunOptions
from rlfleet.orchestrator.run.progress import ProgressReporter
from rlfleet.orchestrator.run.summary import RunSummary
from rlfleet.util.aio import first_error
from rlfleet.util.procs import set_trainer_environment


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlfleet run", description=__doc__.splitlines()[0])
    p.add_argument("file", nargs="?", help="TrainingRun YAML (the same file `kubectl apply` takes)")
    p.add_argument("--summary", type=Path, help="write the run summary (JSON) here")
    p.add_argument("--run-dir", type=Path, help="logs and snapshots (default: runs/<name>-<time>)")
    p.add_argument("--metrics-port", type=int,
                   help="Prometheus port (default: the spec's metricsPort; 0: any free port)")
    p.add_argument("--metrics-host", help="address of the metrics endpoint (default 127.0.0.1; in a pod $POD_IP)")
    p.add_argument("--steps", type=int, help="override spec.trainer.steps")
    p.add_argument("--chaos", action="store_true", help="SIGKILL a random engine now and then, to watch recovery")
    p.add_argument("--chaos-interval", type=float, default=20.0, help="mean seconds between chaos kills")
    p.add_argument("--resume", action="store_true",
                   help="start from the newest complete checkpoint (spec.checkpoint); a broken newest one falls "
                        "back to the one before, with a warning (a recreated trainer pod runs with it)")
    p.add_argument("--record-batches", type=Path, metavar="DIR",
                   help="write each step's training batch and loss to DIR/step_<N>.json, to replay a step")
    p.add_argument("-v", "--verbose", action="store_true")
    k = p.add_argument_group("inside a cluster (the trainer pod)")
    k.add_argument("--kubernetes", action="store_true",
                   help="read the TrainingRun from the API server and drive the fleets the operator runs")
    k.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE"), help="the run's namespace")
    k.add_argument("--training-run", default=os.environ.get("RLFLEET_TRAINING_RUN"), help="the run's name")
    k.add_argument("--kubeconfig", help="default: $KUBECONFIG, else the pod's service account")
    k.add_argument("--snapshot-dir", type=Path, default=os.environ.get("RLFLEET_SNAPSHOT_DIR"),
                   help="the run's shared snapshot volume (default: $RLFLEET_SNAPSHOT_DIR)")
    return p


def _usage_error(message: str) -> int:
    print(f"rlfleet run: {message}", file=sys.stderr)
    return 2


def quiet_libraries() -> None:
    """The run's own progress is the only one on the terminal: no progress bars of transformers, the
    Hugging Face hub or tqdm, no library warnings at import (-v keeps them). Set before they are imported;
    the rank and engine processes inherit it."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        quiet_libraries()
    if args.steps is not None and args.steps < 1:
        return _usage_error("--steps must be >= 1")
    if args.kubernetes:
        if args.file:
            return _usage_error("--kubernetes reads the TrainingRun from the API server; give no FILE")
        missing = [flag for flag, value in (("--namespace", args.namespace), ("--training-run", args.training_run),
                                            ("--snapshot-dir", args.snapshot_dir)) if not value]
        if missing:
            return _usage_error(f"--kubernetes needs {', '.join(missing)}")
        if "RANK" not in os.environ:  # the pod's own process: it launches the ranks of a multi-rank trainer
            run = asyncio.run(_read_cluster_run(args))
            if run is not None and run.spec.trainer.world_size > 1:
                return _launch_cluster_ranks(run, list(sys.argv[1:] if argv is None else argv), args)
        bound = StopBound()
        return _finish(lambda: _run_in_cluster(args, stopping=bound.failed), bound=bound,
                       report=report_path_for(args.snapshot_dir / f"{args.training_run}-summary.json"))
    if not args.file:
        return _usage_error("give a TrainingRun FILE (or --kubernetes inside a cluster)")
    try:
        run = load_training_run(args.file)
    except ManifestError as exc:
        print(f"rlfleet run: {args.file} is not a valid TrainingRun:\n{exc}", file=sys.stderr)
        return 2
    if not_local := local_run_errors(run):
        print(f"rlfleet run: {args.file} cannot run locally:\n{ManifestError(args.file, not_local)}", file=sys.stderr)
        return 2
    if not_installed := tracking.unavailable(run):  # before anything starts, not after the engines
        errors = [FieldError(m.field, m.why, "installed") for m in not_installed]
        print(f"rlfleet run: {args.file} cannot run here:\n{ManifestError(args.file, errors)}", file=sys.stderr)
        return 2
    if gpu_problems := _local_gpu_problems(run):
        print(f"rlfleet run: {args.file} cannot run here: {'; '.join(gpu_problems)}", file=sys.stderr)
        return 2
    if args.steps is not None:
        run.spec.trainer.steps = args.steps
    if args.resume and run.spec.checkpoint is None:
        return _usage_error(f"--resume: {args.file} has no spec.checkpoint, so its runs write no checkpoints")
    from rlfleet.orchestrator.run.local import LocalRun

    run_dir = args.run_dir or Path("runs") / f"{run.metadata.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    # The trainer's variables (spec.trainer.env): this process and its ranks are the trainer; the engines
    # and routers it starts get the environment as it was (a trainer pod's env is its own on Kubernetes).
    set_trainer_environment(literal_env(run.spec.trainer.env))
    if run.spec.trainer.world_size > 1 and "RANK" not in os.environ:  # this process launches the ranks
        return _launch_ranks(run, list(sys.argv[1:] if argv is None else argv), run_dir)
    bound = StopBound(force_stop=lambda: _kill_what_is_left(run_dir, local.snapshots if local.scratch_volume else None))
    options = _options(args, run_dir, host=args.metrics_host or "127.0.0.1",
                       manifest_dir=Path(args.file).resolve().parent, stopping=bound.failed)
    local = LocalRun(run, options)
    return _finish(local.execute, bound=bound,
                   report=report_path_for(args.summary) if args.summary else run_dir / "report.html",
                   so_far=lambda: local.summary)


def _local_gpu_problems(run: TrainingRun) -> list[str]:
    """Before anything starts: the trainer and the CUDA engines need GPUs of their own on this machine."""
    from rlfleet.crds.derive import eval_fleet_spec
    from rlfleet.orchestrator.run.local_gpus import local_gpu_problems, plan_local_gpus

    plan = plan_local_gpus(run.spec, eval_fleet_spec(run.metadata.name or "", run.spec))
    if plan.needed == 0:
        return []
    import torch

    return local_gpu_problems(plan, torch.cuda.device_count())


def _launch_ranks(run: TrainingRun, argv: list[str], run_dir: Path) -> int:
    """A trainer of several ranks: check the layout against the model, then launch; rank 0 runs the run."""
    from rlfleet.orchestrator.run.loop import resolve_model_dir
    from rlfleet.orchestrator.run.ranks import check_before_launch, launch_run

    try:
        model_dir = resolve_model_dir(run.spec.model_path)
        check_before_launch(run, model_dir)
    except RunFailed as exc:
        print(f"rlfleet run: FAILED ({exc.reason}): {exc.message}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        print(f"rlfleet run: FAILED (TrainerSetupFailed): {run.spec.trainer.backend} trainer on "
              f"{run.spec.model_path}: {exc}", file=sys.stderr)
        return 1
    return launch_run(run, argv, model_dir, run_dir)


async def _read_cluster_run(args) -> TrainingRun | None:
    """The run as the API server has it; None when it cannot be read or is invalid (the one-rank path
    then reports why on the run)."""
    from rlfleet.kube.client import ApiError, KubeClient
    from rlfleet.orchestrator.fleet.k8s_backend import TRAININGRUNS

    try:
        async with await KubeClient.load(args.kubeconfig) as kube, asyncio.timeout(60):
            obj = await kube.get(TRAININGRUNS, args.training_run, args.namespace)
    except (ApiError, OSError, TimeoutError):
        return None
    run, _ = _validate_run(obj)
    return run if isinstance(run, TrainingRun) else None


def _validate_run(obj: dict):
    meta = {k: v for k, v in obj["metadata"].items() if k in ("name", "namespace", "labels", "annotations")}
    return validate_object({"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "metadata": meta,
                            "spec": obj.get("spec")})


def _launch_cluster_ranks(run: TrainingRun, argv: list[str], args) -> int:
    """A trainer pod of several ranks: check the layout against the model, find the pod's place in its
    trainer group (spec.trainer.nodes > 1), then launch its ranks here; rank 0 runs `rlfleet run
    --kubernetes`. A setup failure is written on the run (restarting would not help); a layout that fits
    the model is recorded on the run (`status.trainer.layoutChecked`: the operator creates the fleets of a
    run that splits the model only then); a rank's death
    fails this pod (exit 1, the rank's last log lines on stderr: the pod's termination message) and the
    operator replaces the group within spec.trainer.maxRestarts."""
    from rlfleet.kube.client import ApiError
    from rlfleet.orchestrator.run.loop import resolve_model_dir
    from rlfleet.orchestrator.run.ranks import check_before_launch, launch_run

    assert run.metadata.name is not None, "a run read from the API server has a name"
    world = run.spec.trainer.world_size

    def record(error: RunError) -> None:
        message = getattr(error, "message", None) or str(error)
        asyncio.run(_record_rank_failure(args, error.reason, message, world))

    def ranks_stopped(_: RunError) -> None:
        asyncio.run(_record_ranks_stopped(args, world))

    run_dir = args.run_dir or Path(tempfile.gettempdir()) / "rlfleet" / run.metadata.name
    try:
        model_dir = resolve_model_dir(run.spec.model_path)
        check_before_launch(run, model_dir)
    except RunFailed as exc:
        record(exc)
        print(f"rlfleet run: FAILED ({exc.reason}): {exc.message}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        failure = RunFailed("TrainerSetupFailed", f"{run.spec.trainer.backend} trainer on {run.spec.model_path}: {exc}")
        record(failure)
        print(f"rlfleet run: FAILED ({failure.reason}): {failure.message}", file=sys.stderr)
        return 1
    if run.spec.trainer.splits_model:
        # The operator creates the fleets of a run that splits the model only once this is on the run.
        try:
            asyncio.run(_record_layout_checked(args))
        except (ApiError, OSError, TimeoutError) as exc:  # the pod fails; the operator replaces it
            print(f"rlfleet run: FAILED (TrainerStatusUnwritable): could not record the layout check on the run "
                  f"(the fleets wait for it): {exc}", file=sys.stderr)
            return 1
    place = None
    if run.spec.trainer.nodes > 1:
        try:
            place = asyncio.run(_find_group_place(args, run))
        except (ValueError, TimeoutError, OSError, ApiError) as exc:  # the pod fails; the operator replaces the group
            print(f"rlfleet run: FAILED (TrainerGroupUnreachable): {exc}", file=sys.stderr)
            return 1
    return launch_run(run, argv, model_dir, run_dir, on_failure=ranks_stopped, place=place)


async def _find_group_place(args, run: TrainingRun):
    from rlfleet.kube.client import KubeClient
    from rlfleet.orchestrator.run.trainer_group import find_place

    assert run.metadata.name is not None
    async with await KubeClient.load(args.kubeconfig) as kube:
        return await find_place(kube, args.namespace, run.metadata.name, run.spec.trainer.nodes,
                                timeout_s=GROUP_LEADER_TIMEOUT_S)


# Pod 0 of a trainer group may wait for a node, pull an image, or be replaced: its address comes within this.
GROUP_LEADER_TIMEOUT_S = 600.0


async def _record_layout_checked(args) -> None:
    """status.trainer.layoutChecked: the model fits the run's tensor x pipeline parallel layout."""
    from rlfleet.kube.client import KubeClient
    from rlfleet.orchestrator.fleet.k8s_backend import report_run_progress

    async with await KubeClient.load(args.kubeconfig) as kube, asyncio.timeout(30):
        await report_run_progress(kube, args.namespace, args.training_run, trainer={"layoutChecked": True})


async def _record_ranks_stopped(args, world: int) -> None:
    """status.trainer.ready 0: a rank died, so the group stopped as one (the operator replaces it)."""
    from rlfleet.kube.client import ApiError, KubeClient
    from rlfleet.orchestrator.fleet.k8s_backend import report_run_progress

    try:
        async with await KubeClient.load(args.kubeconfig) as kube, asyncio.timeout(30):
            await report_run_progress(kube, args.namespace, args.training_run, trainer={"ranks": world, "ready": 0})
    except (ApiError, OSError, TimeoutError) as exc:
        print(f"rlfleet run: could not record the stopped ranks on the run: {exc}", file=sys.stderr)


async def _record_rank_failure(args, reason: str, message: str, world: int) -> None:
    from rlfleet.kube.client import ApiError, KubeClient
    from rlfleet.orchestrator.fleet.k8s_backend import fail_run, report_run_progress

    try:
        async with await KubeClient.load(args.kubeconfig) as kube, asyncio.timeout(30):
            await report_run_progress(kube, args.namespace, args.training_run, trainer={"ranks": world, "ready": 0})
            await fail_run(kube, args.namespace, args.training_run, reason=reason, message=message)
    except (ApiError, OSError, TimeoutError) as exc:
        print(f"rlfleet run: could not record the failure on the run: {exc}", file=sys.stderr)


def _kill_what_is_left(run_dir: Path, scratch: Path | None) -> None:
    """The last resort of a stop that ran past its bound: SIGKILL every process group of the run (each
    child logs under run_dir) and remove the scratch volume. Runs in a thread: the loop may be stuck.
    Not this process's own group: rank 0 of several ranks logs under run_dir too, in its launcher's
    group (the launcher stops the other ranks when rank 0 exits)."""
    from rlfleet.util.procs import groups_writing_under

    for group in groups_writing_under(run_dir) - {os.getpgrp()}:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, sig)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


def _options(args, run_dir: Path, *, host: str, manifest_dir: Path | None, summary: Path | None = None,
             stopping: Callable[[BaseException], None] | None = None) -> RunOptions:
    return RunOptions(run_dir=run_dir, summary_path=args.summary or summary, chaos=args.chaos,
                      chaos_interval_s=args.chaos_interval, metrics_host=host, metrics_port=args.metrics_port,
                      progress=ProgressReporter(), manifest_dir=manifest_dir, resume=args.resume,
                      record_batches=args.record_batches, stopping=stopping)


async def _run_in_cluster(args, stopping: Callable[[BaseException], None] | None = None) -> RunSummary:
    """Read the run, execute it, and on failure write the reason on the run for the operator."""
    from rlfleet.kube.client import ApiError, KubeClient
    from rlfleet.orchestrator.fleet.k8s_backend import TRAININGRUNS, fail_run
    from rlfleet.orchestrator.run.kubernetes import KubernetesRun

    async with await KubeClient.load(args.kubeconfig) as kube:
        recorded: list[str] = []  # the failure written on the run (once)

        async def record_failure(reason: str, message: str) -> None:
            if recorded:
                return
            recorded.append(reason)
            try:
                async with asyncio.timeout(30):
                    await fail_run(kube, args.namespace, args.training_run, reason=reason, message=message)
            except (ApiError, OSError, TimeoutError) as write_error:
                print(f"rlfleet run: could not record the failure on the run: {write_error}", file=sys.stderr)

        async def failing(error: RunError) -> None:  # as the run's cleanup starts: before a stop bound can cut it
            await record_failure(error.reason, getattr(error, "message", None) or str(error))

        try:
            obj = await kube.get(TRAININGRUNS, args.training_run, args.namespace)
        except ApiError as exc:
            raise RunFailed("TrainingRunUnreadable",
                            f"TrainingRun {args.namespace}/{args.training_run}: {exc}") from None
        run, errors = _validate_run(obj)
        try:
            if run is None:
                raise RunFailed("InvalidSpec", "; ".join(str(e) for e in errors))
            assert isinstance(run, TrainingRun), f"the API server returned a {obj.get('kind')} for a TrainingRun"
            assert run.metadata.name is not None, "an object read from the API server has a name"
            if args.steps is not None:
                run.spec.trainer.steps = args.steps
            name = run.metadata.name
            run_dir = args.run_dir or Path(tempfile.gettempdir()) / "rlfleet" / name
            options = _options(args, run_dir, host=args.metrics_host or os.environ.get("POD_IP") or "0.0.0.0",
                               # A pod has no manifest: relative eval dataset paths (and evaluator
                               # modules) are found on the snapshot volume, as spec.eval.datasets[].path says.
                               manifest_dir=args.snapshot_dir, summary=args.snapshot_dir / f"{name}-summary.json",
                               stopping=stopping)
            options.failing = failing
            return await KubernetesRun(run, options, kube=kube, namespace=args.namespace,
                                       snapshots=args.snapshot_dir, run_uid=obj["metadata"]["uid"]).execute()
        except RunFailed as exc:
            await record_failure(exc.reason, exc.message)
            raise


# A stop (SIGTERM, SIGHUP, Ctrl-C) cancels the run, which stops its engines and routers (each within
# its grace period, all at once) and removes its scratch volume: about 10 s. Whatever the serving
# path is doing, the process exits within STOP_BOUND_S of the signal: past it, what is left of the run
# is SIGKILLed and the process exits at once. A run that fails stops the same way, within
# FAILED_STOP_BOUND_S of the failure: nobody is waiting on it. In a pod the failure is written on the run
# (bounded at 30 s) as the cleanup starts, before any of it: a cleanup cut short at the bound (a large
# checkpoint still being written, say) leaves the run Failed with its reason, never a pod the operator
# would take for a trainer crash and recreate.
STOP_BOUND_S = 20.0
FAILED_STOP_BOUND_S = 60.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
FAILED_STATUS = 1  # a failed run's exit status


class Terminated(Exception):
    """SIGTERM, SIGHUP or SIGINT arrived: the run was cancelled and cleaned up."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _await_chain(awaitable: Any) -> list[Any]:
    """The frames of a suspended coroutine chain, outermost first (following what each one awaits)."""
    frames = []
    while awaitable is not None:
        frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "gi_frame", None)
        if frame is not None:
            frames.append(frame)
        awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "gi_yieldfrom", None)
    return frames


def _still_running(loop: asyncio.AbstractEventLoop, most: int = 20) -> str:
    """The loop's unfinished tasks, each with the chain of calls it waits in (innermost last): what held
    a stop up. Read from another thread while the loop is stuck or busy: a best-effort snapshot."""
    lines = []
    for task in sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name())[:most]:
        frames = _await_chain(task.get_coro())
        chain = " -> ".join(f"{f.f_code.co_name} ({Path(f.f_code.co_filename).name}:{f.f_lineno})"
                            for f in frames[-6:])
        lines.append(f"  {task.get_name()}: {chain or 'not started'}")
    return "rlfleet run: still running at the bound:\n" + "\n".join(lines)


class StopBound:
    """The bound on a stop: once started (a signal, or the run failing), the process exits within the
    stop's bound whatever its cleanup, or the loop's own shutdown (it waits for the threads still
    running), is doing. Past it a thread (the loop may be stuck) names what is still running, calls
    `force_stop()` and exits with the stop's status. The first start counts; after `end()`, none."""

    def __init__(self, seconds: float = STOP_BOUND_S, failed_s: float = FAILED_STOP_BOUND_S,
                 force_stop: Callable[[], None] | None = None):
        self.seconds, self.failed_s = seconds, failed_s
        self.force_stop = force_stop
        self.loop: asyncio.AbstractEventLoop | None = None  # the run's: what is still running in it is named
        self._timer: threading.Timer | None = None
        self._ended = False
        self._lock = threading.Lock()  # started from the loop, ended after it

    def signalled(self, signum: int) -> None:
        self._start(self.seconds, 128 + signum, None)

    def failed(self, error: BaseException | None = None) -> None:
        """The run failed (`error`, when known): its cleanup starts now."""
        self._start(self.failed_s, FAILED_STATUS, error)

    def end(self) -> None:
        """The loop has shut down: nothing is left to bound."""
        with self._lock:
            self._ended = True
            if self._timer is not None:
                self._timer.cancel()

    def _start(self, seconds: float, status: int, error: BaseException | None) -> None:
        with self._lock:
            if self._timer is None and not self._ended:
                self._timer = threading.Timer(seconds, self._force, args=(seconds, status, error))
                self._timer.daemon = True
                self._timer.start()

    def _force(self, seconds: float, status: int, error: BaseException | None) -> None:
        if error is not None:  # said here: the run's own report of it would come after its cleanup
            print(f"rlfleet run: {_failure_line(error)}", file=sys.stderr, flush=True)
        print(f"rlfleet run: stop took longer than {seconds:g} s; killing what is left of the run",
              file=sys.stderr, flush=True)
        try:
            if self.loop is not None:
                print(_still_running(self.loop), file=sys.stderr, flush=True)
        except Exception:  # a report on a stuck loop must never keep the process alive
            pass
        try:
            if self.force_stop is not None:
                self.force_stop()
        finally:
            os._exit(status)


def _failure_line(error: BaseException) -> str:
    error = first_error(error)  # also when raised inside a task group
    if isinstance(error, RunError):
        return f"FAILED ({error.reason}): {getattr(error, 'message', None) or error}"
    return f"FAILED: {type(error).__name__}: {error}"


async def _until_signal(execute: Callable[[], Awaitable[RunSummary]], *, force_stop: Callable[[], None] | None = None,
                        stop_bound_s: float = STOP_BOUND_S, bound: StopBound | None = None) -> RunSummary:
    """Run `execute()`; the first SIGTERM/SIGHUP/SIGINT cancels it (engines, routers and scratch volumes
    are cleaned up on the way out); later ones are ignored so cleanup is not cut short, but the whole
    stop is bounded: the signal starts `bound` (exit status 128 + the signal number), as an exception
    out of `execute()` does (status 1) for the loop's shutdown after it. `bound` is its caller's to end
    once the loop has shut down; None: one of `stop_bound_s` and `force_stop`, ended here."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None, "called from a task"
    own = bound is None
    if bound is None:
        bound = StopBound(stop_bound_s, force_stop=force_stop)
    bound.loop = loop
    received: list[int] = []

    def on_signal(signum: int) -> None:
        if not received:
            received.append(signum)
            bound.signalled(signum)
            task.cancel()

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        return await execute()
    except asyncio.CancelledError:
        if received:
            raise Terminated(received[0]) from None
        raise
    except Exception as exc:
        bound.failed(exc)
        raise
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)
        if own:
            bound.end()


def _run_bounded(execute: Callable[[], Awaitable[RunSummary]], bound: StopBound) -> RunSummary:
    """asyncio.run(execute) with its stop bounded up to the loop's end (which waits for its threads)."""
    try:
        return asyncio.run(_until_signal(execute, bound=bound))
    finally:
        bound.end()


def _finish(execute: Callable[[], Awaitable[RunSummary]], *, force_stop: Callable[[], None] | None = None,
            report: Path | None = None, so_far: Callable[[], RunSummary] | None = None,
            bound: StopBound | None = None) -> int:
    """Run `execute`, print its outcome, and write the run's report to `report` (a failed run's too, from
    `so_far`: the summary as far as it got). `bound`: the run's stop bound (default: one calling
    `force_stop`)."""
    try:
        summary = _run_bounded(execute, bound or StopBound(force_stop=force_stop))
    except RunFailed as exc:
        print(f"rlfleet run: FAILED ({exc.reason}): {exc.message}", file=sys.stderr)
        if report is not None and so_far is not None:
            _write_report(so_far().to_dict(), report)
        return FAILED_STATUS
    except KeyboardInterrupt:
        print("rlfleet run: interrupted; engines and router stopped", file=sys.stderr)
        return 130
    except Terminated as exc:
        if exc.signum == signal.SIGINT:
            print("rlfleet run: interrupted; engines and router stopped", file=sys.stderr)
        else:
            print(f"rlfleet run: stopped by {exc}; engines and router stopped", file=sys.stderr)
        return 128 + exc.signum
    data = summary.to_dict()
    print(f"rlfleet run: {data['steps_completed']}/{data['steps_planned']} steps, reward "
          f"{data['reward_mean_first']} -> {data['reward_mean_last']}, engines recreated "
          f"{data['engines_recreated']}, {data['wall_seconds']:.0f} s", file=sys.stderr)
    restarts = {fleet: n for fleet, n in data.get("router_restarts", {}).items() if n}
    if restarts:
        print("rlfleet run: router restarts " + ", ".join(f"{fleet} {n}" for fleet, n in sorted(restarts.items())),
              file=sys.stderr)
    if data["eval"]:
        scored = [p for p in data["eval"] if not p["skipped"]]
        skipped = [f"{p['step']}:{p['skipped']}" for p in data["eval"] if p["skipped"]]
        last = scored[-1] if scored else None
        print(f"rlfleet run: eval {len(scored)}/{len(data['eval'])} points scored"
              + (f", last @{last['step']} {last['scores']}" if last else "")
              + (f", skipped {' '.join(skipped)}" if skipped else "")
              + f", {data['eval_snapshots_left']} eval snapshot(s) left on the volume", file=sys.stderr)
    if report is not None:
        _write_report(data, report)
    return 0


def _write_report(data: dict, path: Path) -> None:
    """The run's report (`rlfleet report`): HTML with plots and a PNG of the main panel; never fails the run."""
    try:
        written = write_report(data, path, title=f"rlfleet run: {path.parent.name or path.stem}")
    except OSError as exc:
        print(f"rlfleet run: could not write the report {path}: {exc}", file=sys.stderr)
        return
    print(f"rlfleet run: report {written.html} (main panel {written.png})", file=sys.stderr)
