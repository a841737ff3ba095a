"""MlflowTracker.open against a real MLflow server, its answers lost on the way back or never coming: a
retried open resumes the same run (found by its open tag when runs/create's answer was lost; a params batch
the server took sent again), read back with MLflow's own client as the experiment's only run. Through a
TrackerSink, an open that gets no answer is cut by the sink's open bound (the record dropped) and the retry
before the next record completes the same run."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from helpers.mlflow_server import MlflowReader, MlflowServer
from rlfleet.observability.tracking.mlflow import MlflowTracker
from rlfleet.observability.tracking.sink import TrackerSink

PARAMS = {f"spec.p{i:03}": str(i) for i in range(113)}  # two batches


class AnswerLost(Exception):
    pass


def lose_answers_once(tracker: MlflowTracker, lost: set[str]) -> None:
    """Each request named in `lost` (its path, or "params-2" for the second params batch) reaches the
    server, its answer does not reach the tracker, once."""
    request = tracker._request

    async def losing(method: str, path: str, **kw):
        answer = await request(method, path, **kw)
        params = (kw.get("json") or {}).get("params") or []
        which = "params-2" if any(p["key"] == "spec.p100" for p in params) else path
        if which in lost:
            lost.discard(which)
            raise AnswerLost(which)
        return answer

    tracker._request = losing  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def mlflow(tmp_path_factory) -> Iterator[tuple[MlflowServer, MlflowReader]]:
    """One server and one reader for the module (each test its own experiment)."""
    reader = MlflowReader()
    server = MlflowServer(tmp_path_factory.mktemp("mlflow")).start()
    try:
        reader.wait_ready()
        yield server, reader
    finally:
        server.stop()
        reader.close()


async def test_open_retried_after_lost_answers_makes_one_run(mlflow):
    server, reader = mlflow
    tracker = MlflowTracker(server.url, "resumed", "quick", timeout_s=30)
    lose_answers_once(tracker, lost := {"/runs/create", "params-2"})
    opened, tries = False, 0
    while not opened:
        tries += 1
        try:
            await tracker.open(PARAMS)
            opened = True
        except AnswerLost:
            pass
    assert tries == 3 and not lost
    await tracker.log(1, {"train/loss": 0.5})
    await tracker.close("FINISHED")
    run = reader.read(server.url, "resumed")  # an error unless the experiment has exactly one run
    assert "error" not in run, run
    assert run["name"] == "quick" and run["params"] == PARAMS
    assert run["metrics"] == {"train/loss": [[1, 0.5]]}


def answers_never_come_once(tracker: MlflowTracker, stalls: dict[str, bool]) -> list[str]:
    """The first request of each path in `stalls` (or "params-2", the second params batch) gets no answer:
    with True the server takes it first, with False it never reaches the server. The paths of every request
    the tracker makes, in order."""
    request, calls = tracker._request, []

    async def stalling(method: str, path: str, **kw):
        params = (kw.get("json") or {}).get("params") or []
        which = "params-2" if any(p["key"] == "spec.p100" for p in params) else path
        calls.append(which)
        taken = stalls.pop(which, None)
        if taken is False:
            await asyncio.Event().wait()
        answer = await request(method, path, **kw)
        if taken:
            await asyncio.Event().wait()
        return answer

    tracker._request = stalling  # type: ignore[method-assign]
    return calls


async def open_cut_once_then_one_record(tracker: MlflowTracker) -> None:
    """Two records through a sink: the first open is cut by its bound (the record dropped), the retry
    before the second record completes it."""
    sink = TrackerSink(tracker, PARAMS, call_timeout_s=5, open_timeout_s=2.0)
    sink.start()
    sink.submit(1, {"train/loss": 1.0})
    sink.submit(2, {"train/loss": 0.5})
    await sink.close()
    assert sink.counts.written == 1 and sink.counts.dropped == 1, sink.counts
    assert "open: no answer within 2 s" in (sink.counts.failure or ""), sink.counts.failure


async def test_open_cut_in_its_params_resumes_the_same_run(mlflow):
    server, reader = mlflow
    tracker = MlflowTracker(server.url, "cut-in-params", "quick", timeout_s=30)
    calls = answers_never_come_once(tracker, {"params-2": False})
    await open_cut_once_then_one_record(tracker)
    assert calls.count("/experiments/get-by-name") + calls.count("/experiments/create") == 2  # once: not found, made
    assert calls.count("/runs/create") == 1 and calls.count("params-2") == 2
    run = reader.read(server.url, "cut-in-params")  # an error unless the experiment has exactly one run
    assert "error" not in run, run
    assert run["params"] == PARAMS and run["metrics"] == {"train/loss": [[2, 0.5]]} and run["status"] == "FINISHED"


async def test_run_created_but_unanswered_is_found_not_made_again(mlflow):
    server, reader = mlflow
    tracker = MlflowTracker(server.url, "created-unanswered", "quick", timeout_s=30)
    calls = answers_never_come_once(tracker, {"/runs/create": True})
    await open_cut_once_then_one_record(tracker)
    assert calls.count("/runs/create") == 1 and calls.count("/runs/search") == 1, calls
    run = reader.read(server.url, "created-unanswered")
    assert "error" not in run, run
    assert run["params"] == PARAMS and run["metrics"] == {"train/loss": [[2, 0.5]]} and run["status"] == "FINISHED"
