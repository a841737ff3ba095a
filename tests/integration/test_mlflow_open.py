"""MlflowTracker.open against a real MLflow server, its answers lost on the way back: a retried open resumes
the same run (found by its open tag when runs/create's answer was lost; a params batch the server took sent
again), read back with MLflow's own client as the experiment's only run."""
from __future__ import annotations

from pathlib import Path

from helpers.mlflow_server import MlflowReader, MlflowServer
from rlfleet.observability.tracking.mlflow import MlflowTracker

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


async def test_open_retried_after_lost_answers_makes_one_run(tmp_path: Path):
    reader = MlflowReader()
    server = MlflowServer(tmp_path / "mlflow").start()
    try:
        reader.wait_ready()
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
    finally:
        server.stop()
        reader.close()
