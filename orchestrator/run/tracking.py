"""The run's trackers (spec.tracking), from its spec: each record of the summary goes to every one.

`RunTrackers.step(record)` and `.eval(point)` never wait; `close()` drains within a bound and puts each
tracker's counts (written, dropped, its first failure) in the summary's `tracking`.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlfleet.crds.models import TrainingRun
from rlfleet.observability.tracking.params import flatten
from rlfleet.observability.tracking.sink import TrackerSink
from rlfleet.orchestrator.run.summary import EVENT_KINDS, RunEvent, eval_scalars, scalars

DRAIN_S = 30.0  # what the trackers may still take once training is done
WANDB_START_S = 30.0  # the W&B client's own process: started and wandb imported, on a loaded machine
WANDB_DIR = "wandb"  # W&B's run files (an offline run's .wandb log), relative to the volume like logDir


class TrackerUnavailable(Exception):
    def __init__(self, field: str, why: str):
        super().__init__(f"{field}: {why}")
        self.field = field
        self.why = why


def params_of(run: TrainingRun) -> dict[str, str]:
    return flatten(run.spec.model_dump(mode="json", by_alias=True, exclude_none=True))


def unavailable(run: TrainingRun) -> list[TrackerUnavailable]:
    """The configured trackers whose package is missing here, each naming its field (checked when a run
    is loaded, before anything starts)."""
    tracking = run.spec.tracking
    found: list[TrackerUnavailable] = []
    if tracking is None:
        return found
    if tracking.tensorboard is not None:
        from rlfleet.observability.tracking import tensorboard

        if (why := tensorboard.available()) is not None:
            found.append(TrackerUnavailable("spec.tracking.tensorboard", why))
    if tracking.wandb is not None:
        from rlfleet.observability.tracking import wandb

        if (why := wandb.available()) is not None:
            found.append(TrackerUnavailable("spec.tracking.wandb", why))
    return found


def build_sinks(run: TrainingRun, *, tracker_dir: Callable[[str], Path],
                on_warning: Callable[[str], None]) -> list[TrackerSink]:
    """One sink per configured tracker (not started). `tracker_dir(relative)` is where a platform puts a
    tracker's files (`<volume>/<relative>/<run>`). Raises TrackerUnavailable, naming the field, when a
    tracker cannot run here."""
    tracking = run.spec.tracking
    if tracking is None:
        return []
    if missing := unavailable(run):
        raise missing[0]
    params = params_of(run)
    sinks: list[TrackerSink] = []
    if tracking.tensorboard is not None:
        from rlfleet.observability.tracking import tensorboard

        sinks.append(TrackerSink(tensorboard.TensorBoardTracker(tracker_dir(tracking.tensorboard.log_dir)),
                                 params, on_warning=on_warning))
    if tracking.mlflow is not None:
        from rlfleet.observability.tracking.mlflow import MlflowTracker, log_bound_s, open_bound_s

        m = tracking.mlflow
        assert run.metadata.name is not None
        tracker = MlflowTracker(m.tracking_uri, m.experiment, m.run_name or run.metadata.name,
                                timeout_s=m.timeout_seconds, tags={"rlfleet.trainingRun": run.metadata.name})
        # timeoutSeconds bounds each request; open and a large record make several (params and scalars in
        # batches), so their bounds scale.
        sinks.append(TrackerSink(tracker, params, call_timeout_s=m.timeout_seconds + 1.0,
                                 open_timeout_s=open_bound_s(m.timeout_seconds, len(params)),
                                 log_timeout_s=functools.partial(log_bound_s, m.timeout_seconds),
                                 on_warning=on_warning))
    if tracking.wandb is not None:
        from rlfleet.observability.tracking.wandb import WandbOptions, WandbTracker

        w = tracking.wandb
        assert run.metadata.name is not None
        options = WandbOptions(project=w.project, entity=w.entity, run_name=w.run_name or run.metadata.name,
                               mode=w.mode, base_url=w.base_url, timeout_s=w.timeout_seconds,
                               directory=tracker_dir(WANDB_DIR))
        # A call's bound covers starting the W&B process; finishing gets W&B's timeout and the kill's grace.
        sinks.append(TrackerSink(WandbTracker(options), params, call_timeout_s=w.timeout_seconds + WANDB_START_S,
                                 on_warning=on_warning))
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
