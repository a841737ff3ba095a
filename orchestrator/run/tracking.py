"""The run's trackers (spec.tracking), from its spec: each record of the summary goes to every one.

`RunTrackers.step(record)` and `.eval(point)` never wait; `close()` drains within a bound and puts each
tracker's counts (written, dropped, its first failure) in the summary's `tracking`.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlfleet.crds.models import TrainingRun
from rlfleet.observability.tracking.params import flatten
from rlfleet.observability.tracking.sink import TrackerSink
from rlfleet.orchestrator.run.summary import EVENT_KINDS, RunEvent, eval_scalars, scalars

DRAIN_S = 30.0  # what the trackers may still take once training is done


class TrackerUnavailable(Exception):
    def __init__(self, field: str, why: str):
        super().__init__(f"{field}: {why}")
        self.field = field


def params_of(run: TrainingRun) -> dict[str, str]:
    return flatten(run.spec.model_dump(mode="json", by_alias=True, exclude_none=True))


def build_sinks(run: TrainingRun, *, tensorboard_dir: Callable[[str], Path],
                on_warning: Callable[[str], None]) -> list[TrackerSink]:
    """One sink per configured tracker (not started). `tensorboard_dir(logDir)` is where a platform puts
    the event files. Raises TrackerUnavailable, naming the field, when a tracker cannot run here."""
    tracking = run.spec.tracking
    if tracking is None:
        return []
    params = params_of(run)
    sinks: list[TrackerSink] = []
    if tracking.tensorboard is not None:
        from rlfleet.observability.tracking import tensorboard

        why = tensorboard.available()
        if why is not None:
            raise TrackerUnavailable("spec.tracking.tensorboard", why)
        sinks.append(TrackerSink(tensorboard.TensorBoardTracker(tensorboard_dir(tracking.tensorboard.log_dir)),
                                 params, on_warning=on_warning))
    if tracking.mlflow is not None:
        from rlfleet.observability.tracking.mlflow import MlflowTracker

        m = tracking.mlflow
        assert run.metadata.name is not None
        tracker = MlflowTracker(m.tracking_uri, m.experiment, m.run_name or run.metadata.name,
                                timeout_s=m.timeout_seconds, tags={"rlfleet.trainingRun": run.metadata.name})
        sinks.append(TrackerSink(tracker, params, call_timeout_s=m.timeout_seconds + 1.0, on_warning=on_warning))
    return sinks


def event_totals(events: list[RunEvent], step: int) -> dict[str, float]:
    """`events/<kind>`: events of each kind up to and including `step`."""
    return {f"events/{k}": float(sum(1 for e in events if e.kind == k and e.step <= step)) for k in EVENT_KINDS}


class RunTrackers:
    def __init__(self, sinks: list[TrackerSink]):
        self.sinks = sinks

    def start(self) -> None:
        for sink in self.sinks:
            sink.start()

    def step(self, record: dict[str, Any], events: list[RunEvent]) -> None:
        values = {**scalars(record), **event_totals(events, record["step"])}
        for sink in self.sinks:
            sink.submit(record["step"], values)

    def eval(self, point: dict[str, Any]) -> None:
        values = eval_scalars(point)
        if values:
            for sink in self.sinks:
                sink.submit(int(point["step"]), values)

    async def close(self, status: str) -> dict[str, dict[str, Any]]:
        for sink in self.sinks:
            await sink.close(status, drain_s=DRAIN_S)
        return {sink.tracker.name: sink.counts.as_dict() for sink in self.sinks}
