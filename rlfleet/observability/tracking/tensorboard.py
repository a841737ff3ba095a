"""TensorBoard event files, written with TensorBoard's own event writer (in a thread: file I/O).

One subdirectory per run (`<logDir>/<run>`); scalars as simple values, the run's flattened spec as a
text summary (`spec`), so `tensorboard --logdir <logDir>` shows every run on the volume side by side.
Eval series (`eval/...`) go to `<run>/eval`: eval points settle after later training steps, and
TensorBoard's reader drops the events past a step that goes backwards within one directory.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def available() -> str | None:
    """None when the tensorboard package can be imported, else why not."""
    try:
        import tensorboard.summary.writer.event_file_writer  # noqa: F401
    except ImportError as exc:
        return f"the tensorboard package is not installed ({exc}); scripts/setup.sh installs it"
    return None


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self._writer: Any = None
        self._eval_writer: Any = None

    async def open(self, params: Mapping[str, str]) -> None:
        await asyncio.to_thread(self._open, dict(params))

    async def log(self, step: int, scalars: Mapping[str, float]) -> None:
        await asyncio.to_thread(self._log, step, dict(scalars))

    async def close(self, status: str) -> None:
        await asyncio.to_thread(self._close)

    def _open(self, params: dict[str, str]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.plugins.text import metadata as text_metadata
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        from tensorboard.util import tensor_util

        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self._writer is None:  # an open tried again (the sink retries a failed one) keeps one event file
            self._writer = EventFileWriter(str(self.log_dir), flush_secs=5)
        table = "\n".join(f"| {k} | {v} |" for k, v in sorted(params.items()))
        text = tensor_util.make_tensor_proto(["| param | value |\n|---|---|\n" + table])
        meta = text_metadata.create_summary_metadata(display_name="spec", description="the TrainingRun spec")
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag="spec", tensor=text, metadata=meta)])
        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=0, summary=summary))

    def _log(self, step: int, scalars: dict[str, float]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        for is_eval in (False, True):
            chosen = sorted((tag, v) for tag, v in scalars.items() if tag.startswith("eval/") == is_eval)
            if not chosen:
                continue
            if is_eval and self._eval_writer is None:
                self._eval_writer = EventFileWriter(str(self.log_dir / "eval"), flush_secs=5)
            writer = self._eval_writer if is_eval else self._writer
            values = [summary_pb2.Summary.Value(tag=tag, simple_value=value) for tag, value in chosen]
            writer.add_event(event_pb2.Event(wall_time=time.time(), step=step,
                                             summary=summary_pb2.Summary(value=values)))
            writer.flush()

    def _close(self) -> None:
        for writer in (self._writer, self._eval_writer):
            if writer is not None:
                writer.close()
        self._writer = self._eval_writer = None
