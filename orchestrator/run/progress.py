"""Progress of a run: one redrawn status line on a terminal, plain log lines otherwise."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO


@dataclass
class ProgressState:
    step: int = 0
    steps: int = 0
    reward: float | None = None
    weight_version: str = "-"
    engines_ready: int = 0
    engines_total: int = 0
    samples_per_s: float = 0.0
    phase: str = "starting"


def format_progress(s: ProgressState) -> str:
    reward = "-" if s.reward is None else f"{s.reward:.3f}"
    return (f"step {s.step}/{s.steps}  reward {reward}  weights v{s.weight_version}  "
            f"engines {s.engines_ready}/{s.engines_total}  rollout {s.samples_per_s:.1f} samples/s  [{s.phase}]")


class ProgressReporter:
    def __init__(self, stream: TextIO | None = None, *, tty: bool | None = None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self._last_line = ""

    def update(self, state: ProgressState) -> None:
        """Redraw the status line (TTY only; plain mode prints on events)."""
        if self.tty:
            line = format_progress(state)
            pad = max(0, len(self._last_line) - len(line))
            self.stream.write("\r" + line + " " * pad)
            self.stream.flush()
            self._last_line = line

    def event(self, message: str, state: ProgressState | None = None) -> None:
        """A line that stays: steps done, engines dying and coming back, failures."""
        stamp = time.strftime("%H:%M:%S")
        text = f"{stamp} {message}" + (f"  ({format_progress(state)})" if state and not self.tty else "")
        if self.tty:
            self.stream.write("\r" + text + " " * max(0, len(self._last_line) - len(text)) + "\n")
            self._last_line = ""
            if state is not None:
                self.update(state)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._last_line:
            self.stream.write("\n")
            self.stream.flush()
