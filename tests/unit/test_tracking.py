"""Trackers beside the run: TensorBoard files read back with TensorBoard's reader, an offline W&B run read
back with W&B's own reader; a tracker whose server is gone or silent never holds the caller, warns once
and counts its drops."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
from pathlib import Path

from prometheus_client import REGISTRY

from rlfleet.observability.tracking.mlflow import (
    MlflowTracker,
    log_bound_s,
    open_bound_s,
    open_requests,
    param_batches,
)
from rlfleet.observability.tracking.params import flatten
from rlfleet.observability.tracking.sink import TrackerSink
from rlfleet.observability.tracking.tensorboard import TensorBoardTracker
from rlfleet.observability.tracking.wandb import WandbOptions, WandbTracker
from rlfleet.observability.tracking.wandb_worker import history_rows
from rlfleet.util.ports import free_port


def dropped(tracker: str) -> float:
    return REGISTRY.get_sample_value("rlfleet_tracker_records_total",
                                     {"tracker": tracker, "outcome": "dropped"}) or 0.0


def test_flatten_spec():
    assert flatten({"trainer": {"steps": 3, "lr": 0.5, "on": True, "x": None},
                    "eval": {"datasets": [{"name": "a"}], "tags": []}}) == {
        "trainer.steps": "3", "trainer.lr": "0.5", "trainer.on": "true", "eval.datasets.0.name": "a",
        "eval.tags": "[]"}


async def write_three_steps_and_an_eval(sink: TrackerSink) -> None:
    """Steps 1..3 and an eval point that settled after step 3, through `sink`; all written, none dropped."""
    sink.start()
    for step in (1, 2, 3):
        sink.submit(step, {"train/reward_mean": step / 4, "time/train": 0.5})
    sink.submit(0, {"eval/rotate": 0.125})
    await sink.close()
    assert sink.counts.written == 4 and sink.counts.dropped == 0 and sink.counts.failure is None


async def test_tensorboard_series_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TrackerSink(TensorBoardTracker(tmp_path / "run"), {"trainer.steps": "3"})
    await write_three_steps_and_an_eval(sink)
    acc = EventAccumulator(str(tmp_path / "run"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["time/train", "train/reward_mean"]
    assert [(e.step, e.value) for e in acc.Scalars("train/reward_mean")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert "spec" in acc.Tags()["tensors"]
    evals = EventAccumulator(str(tmp_path / "run" / "eval"))
    evals.Reload()
    assert [(e.step, e.value) for e in evals.Scalars("eval/rotate")] == [(0, 0.125)]


async def test_tensorboard_open_tried_again_keeps_one_event_file(tmp_path):
    tracker = TensorBoardTracker(tmp_path / "run")
    await tracker.open({"trainer.steps": "3"})
    await tracker.open({"trainer.steps": "3"})  # as the sink does after an open that timed out
    await tracker.log(1, {"train/loss": 0.5})
    await tracker.close("FINISHED")
    assert len(list((tmp_path / "run").glob("events.out.tfevents.*"))) == 1


async def test_server_down_warns_once_and_counts_drops():
    port = free_port()  # nothing listens there
    warnings: list[str] = []
    before = dropped("mlflow")
    sink = TrackerSink(MlflowTracker(f"http://127.0.0.1:{port}", "e", "r", timeout_s=2), {},
                       call_timeout_s=3, on_warning=warnings.append)
    sink.start()
    loop = asyncio.get_running_loop()
    began = loop.time()
    for step in range(1, 6):
        sink.submit(step, {"train/loss": 1.0})
    assert loop.time() - began < 1.0  # submitting never waits (a call would: the server is down, 2 s timeout)
    await sink.close()
    assert sink.counts.written == 0 and sink.counts.dropped == 5
    assert len(warnings) == 1 and "mlflow" in warnings[0] and "ClientConnectorError" in (sink.counts.failure or "")
    assert dropped("mlflow") - before == 5


async def test_silent_server_is_bounded():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # accepts connections, never answers
    port = listener.getsockname()[1]
    try:
        sink = TrackerSink(MlflowTracker(f"http://127.0.0.1:{port}", "e", "r", timeout_s=0.3), {},
                           call_timeout_s=0.5)
        sink.start()
        sink.submit(1, {"train/loss": 1.0})
        sink.submit(2, {"train/loss": 1.0})
        loop = asyncio.get_running_loop()
        began = loop.time()
        await sink.close(drain_s=0.5)
        assert loop.time() - began < 5.0  # bounded by drain_s, not by the silent server
        assert sink.counts.written == 0 and sink.counts.dropped == 2
        assert sink.counts.failure is not None
    finally:
        listener.close()


def test_mlflow_open_bound_scales_with_its_requests():
    params = {f"p{i:03}": str(i) for i in range(113)}  # as many as the GPU example's spec flattens to
    assert [len(b) for b in param_batches(params)] == [100, 13]
    assert [len(b) for b in param_batches(params, {f"p{i:03}" for i in range(100)})] == [13]
    assert param_batches({"k" * 300: "v" * 7000}) == [[{"key": "k" * 250, "value": "v" * 6000}]]
    assert open_requests(0) == 3 and open_requests(100) == 4 and open_requests(113) == 5
    assert open_bound_s(10, 113) == 51


def test_mlflow_sink_bounds_open_by_its_requests():
    from helpers.manifests import RUN
    from rlfleet.crds.loader import load_text
    from rlfleet.orchestrator.run.tracking import build_sinks, params_of

    (doc,) = load_text(RUN + "  tracking: {mlflow: {trackingUri: 'http://mlflow:5000', timeoutSeconds: 2}}\n")
    assert doc.obj is not None and doc.errors == []
    (sink,) = build_sinks(doc.obj, tracker_dir=lambda relative: Path(relative), on_warning=print)
    assert sink.call_timeout_s == 3
    assert sink.open_timeout_s == open_bound_s(2, len(params_of(doc.obj))) >= 4 * 2
    # A record of 2,500 scalars is three log-batch requests of 1,000 at most.
    assert sink.log_timeout_s(10) == log_bound_s(2, 10) == 3 and sink.log_timeout_s(2500) == log_bound_s(2, 2500) == 7


class SlowOpen:
    """A tracker whose open takes longer than one call's bound."""

    name = "slow-open"

    def __init__(self) -> None:
        self.logged: list[int] = []

    async def open(self, params):
        await asyncio.sleep(0.3)

    async def log(self, step, scalars):
        self.logged.append(step)

    async def close(self, status):
        pass


async def test_sink_bounds_open_apart_from_other_calls():
    tracker = SlowOpen()
    sink = TrackerSink(tracker, {}, call_timeout_s=0.1, open_timeout_s=5)
    sink.start()
    sink.submit(1, {"train/loss": 1.0})
    await sink.close()
    assert tracker.logged == [1] and sink.counts.written == 1 and sink.counts.failure is None


class StuckLog:
    """A tracker whose log never answers, and whose cancelled call takes a moment to wind down."""

    name = "stuck"

    def __init__(self) -> None:
        self.logging = asyncio.Event()

    async def open(self, params):
        pass

    async def log(self, step, scalars):
        self.logging.set()
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.shield(asyncio.sleep(0.5))

    async def close(self, status):
        pass


async def test_a_caller_cancelled_while_the_sink_closes_is_cancelled():
    """Ctrl-C while the run's end waits for a tracker's worker to stop: the cancellation reaches the caller."""
    tracker = StuckLog()
    sink = TrackerSink(tracker, {}, call_timeout_s=60)
    sink.start()
    sink.submit(1, {"train/loss": 1.0})
    await tracker.logging.wait()
    closing = asyncio.create_task(sink.close(drain_s=0.01))
    await asyncio.sleep(0.1)  # the drain is over: close waits for the worker's call to wind down
    closing.cancel()
    await asyncio.wait([closing], timeout=5)
    assert closing.cancelled()


class LogsInBatches:
    """A tracker whose log takes 0.15 s per 1,000 scalars, as a tracker of bounded batches would."""

    name = "batches"

    def __init__(self) -> None:
        self.logged: list[int] = []

    async def open(self, params):
        pass

    async def log(self, step, scalars):
        await asyncio.sleep(0.15 * -(-len(scalars) // 1000))
        self.logged.append(step)

    async def close(self, status):
        pass


async def test_sink_bounds_a_large_record_by_its_requests():
    tracker = LogsInBatches()
    sink = TrackerSink(tracker, {}, call_timeout_s=0.25, log_timeout_s=lambda n: 0.25 * -(-n // 1000))
    sink.start()
    sink.submit(1, {f"eval/{i}": 1.0 for i in range(2500)})  # three batches: 0.45 s within 0.75 s
    sink.submit(2, {"train/loss": 1.0})
    await sink.close()
    assert tracker.logged == [1, 2] and sink.counts.written == 2 and sink.counts.failure is None
    one_bound = TrackerSink(LogsInBatches(), {}, call_timeout_s=0.25)  # what a single call's bound did
    one_bound.start()
    one_bound.submit(1, {f"eval/{i}": 1.0 for i in range(2500)})
    await one_bound.close()
    assert one_bound.counts.dropped == 1 and "no answer within 0.25 s" in (one_bound.counts.failure or "")


def test_tracking_fields_are_checked_naming_the_field():
    from helpers.manifests import RUN, errors

    assert errors(RUN + "  tracking: {tensorboard: {}, mlflow: {trackingUri: 'http://mlflow:5000'}}\n") == []
    found = errors(RUN + "  tracking: {mlflow: {trackingUri: 'mlflow:5000'}}\n")
    assert [f for f, _ in found] == ["spec.tracking.mlflow.trackingUri"]
    found = errors(RUN + "  tracking: {tensorboard: {logDir: '../elsewhere'}}\n")
    assert [f for f, _ in found] == ["spec.tracking.tensorboard.logDir"]
    assert errors(RUN + "  tracking: {wandb: {project: p, mode: offline, entity: team, baseUrl: 'http://wb:8080', "
                  "apiKey: {secretKeyRef: {name: wandb, key: api-key}}}}\n") == []
    found = errors(RUN + "  tracking: {wandb: {project: 'a/b'}}\n")
    assert [f for f, _ in found] == ["spec.tracking.wandb.project"]
    found = errors(RUN + "  tracking: {wandb: {project: p, mode: disabled}}\n")
    assert [f for f, _ in found] == ["spec.tracking.wandb.mode"]
    found = errors(RUN + "  tracking: {wandb: {project: p, apiKey: 'abc'}}\n")
    assert [f for f, _ in found] == ["spec.tracking.wandb.apiKey"]
    found = errors(RUN + "  tracking: {wandb: {project: p, apiKey: {value: abc}}}\n")
    assert sorted(f for f, _ in found) == ["spec.tracking.wandb.apiKey.secretKeyRef",
                                           "spec.tracking.wandb.apiKey.value"]
    found = errors(RUN + "  tracking: {wandb: {entity: e}}\n")
    assert [f for f, _ in found] == ["spec.tracking.wandb.project"]
    found = errors(RUN + "  tracking: {mlflow: {trackingUri: 'http://m', timeoutSeconds: 0}}\n")
    assert [f for f, _ in found] == ["spec.tracking.mlflow.timeoutSeconds"]


def test_wandb_rows_keep_eval_points_on_their_own_step():
    assert history_rows(3, {"train/loss": 1, "time/train": 0.5}) == [
        {"step": 3.0, "time/train": 0.5, "train/loss": 1.0}]
    assert history_rows(0, {"eval/rotate": 0.25, "eval/seconds": 2}) == [
        {"eval/step": 0.0, "eval/rotate": 0.25, "eval/seconds": 2.0}]
    assert history_rows(4, {"train/loss": 1, "eval/rotate": 0.5}) == [
        {"step": 4.0, "train/loss": 1.0}, {"eval/step": 4.0, "eval/rotate": 0.5}]
    assert history_rows(1, {}) == []


async def test_wandb_offline_run_read_back(tmp_path):
    from helpers.wandb_log import offline_log, read_log

    options = WandbOptions(project="p", run_name="quick", directory=tmp_path / "wb", mode="offline", timeout_s=30)
    sink = TrackerSink(WandbTracker(options), {"trainer.steps": "3"}, call_timeout_s=60)
    await write_three_steps_and_an_eval(sink)
    log = read_log(offline_log(tmp_path / "wb"))
    assert log.run["display_name"] == "quick" and log.run["project"] == "p" and log.exit_code == 0
    assert log.config["trainer.steps"] == "3"
    assert log.series == {"train/reward_mean": [(1, 0.25), (2, 0.5), (3, 0.75)],
                          "time/train": [(1, 0.5), (2, 0.5), (3, 0.5)], "eval/rotate": [(0, 0.125)]}


async def test_wandb_server_down_warns_once_counts_drops_and_finishes_in_bounds(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # a well-formed key: the client gets as far as the server
    port = free_port()  # nothing listens there
    warnings: list[str] = []
    before = dropped("wandb")
    options = WandbOptions(project="p", run_name="r", directory=tmp_path / "wb", mode="online",
                           base_url=f"http://127.0.0.1:{port}", timeout_s=2)
    sink = TrackerSink(WandbTracker(options), {}, call_timeout_s=30, on_warning=warnings.append)
    sink.start()
    loop = asyncio.get_running_loop()
    began = loop.time()
    for step in range(1, 4):
        sink.submit(step, {"train/loss": 1.0})
    assert loop.time() - began < 1.0  # submitting never waits (a call would: the server is down, 2 s timeout)
    await sink.close(drain_s=60)
    assert loop.time() - began < 90
    assert sink.counts.written == 0 and sink.counts.dropped == 3
    assert len(warnings) == 1 and "tracker wandb failed" in warnings[0]
    assert "127.0.0.1" in (sink.counts.failure or ""), sink.counts.failure
    assert dropped("wandb") - before == 3


def children_of(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").glob("*/children") for c in task.read_text().split()]


def gone(pid: int) -> bool:
    """No such process, or a zombie (until init reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].startswith("Z")
    except (FileNotFoundError, ProcessLookupError):
        return True

async def test_wandb_finish_that_hangs_is_bounded_and_its_processes_killed(tmp_path):
    """The W&B process stopped (SIGSTOP) after its run started: close returns within W&B's timeout plus the
    grace with an error saying so (the sink warns it), and no process of its group is left."""
    from rlfleet.observability.tracking.wandb import EXIT_GRACE_S, WandbError

    options = WandbOptions(project="p", run_name="r", directory=tmp_path / "wb", mode="offline", timeout_s=1)
    tracker = WandbTracker(options)
    await asyncio.wait_for(tracker.open({}), 60)
    await asyncio.wait_for(tracker.log(1, {"train/loss": 1.0}), 30)
    assert tracker._proc is not None
    group = tracker._proc.pid
    service = children_of(group)
    assert service, "W&B's service process (wandb-core) runs under the W&B process"
    os.killpg(group, signal.SIGSTOP)
    loop = asyncio.get_running_loop()
    began = loop.time()
    try:
        await tracker.close("FINISHED")
        raise AssertionError("close of a stopped W&B process returned no error")
    except WandbError as exc:
        assert "did not end within" in str(exc)
    assert loop.time() - began < 1 + EXIT_GRACE_S + 10  # a loaded machine
    for pid in service:
        assert gone(pid), f"wandb-core {pid} is left"
    try:
        os.killpg(group, 0)
        raise AssertionError(f"processes of group {group} are left")
    except ProcessLookupError:
        pass
