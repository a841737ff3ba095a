"""Progress of a run: on a terminal, a redrawn status line (a step bar with elapsed time and ETA, the
current phase with its own elapsed time, each engine's start-up state); otherwise plain log lines, one
per event (CI, `kubectl logs`).

The formatting is pure (`format_status`, `format_progress`, `startup_stage`); `ProgressReporter` writes.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

BAR_WIDTH = 20


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
    started_at: float = field(default_factory=time.monotonic)  # the run's start (monotonic clock)
    phase_since: float = field(default_factory=time.monotonic)
    training_since: float | None = None  # when the first step of this process began
    first_step: int = 0  # the step count then (a resumed run's ETA counts only its own steps)
    engines: dict[str, str] = field(default_factory=dict)  # slot -> starting, loading, healthy, pinned v<N>, dead
    trainer: str = ""  # a trainer of several ranks: "<world> ranks tp<T> pp<P> dp<D>" (one rank: nothing)

    def set_phase(self, phase: str, now: float | None = None) -> None:
        if phase != self.phase:
            self.phase = phase
            self.phase_since = time.monotonic() if now is None else now


def format_progress(s: ProgressState) -> str:
    """The plain form (one line per event, no redraw)."""
    reward = "-" if s.reward is None else f"{s.reward:.3f}"
    trainer = f"trainer {s.trainer}  " if s.trainer else ""
    return (f"step {s.step}/{s.steps}  reward {reward}  weights v{s.weight_version}  {trainer}"
            f"engines {s.engines_ready}/{s.engines_total}  rollout {s.samples_per_s:.1f} samples/s  [{s.phase}]")


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rest = divmod(seconds, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m:02d}:{sec:02d}"


def eta_seconds(s: ProgressState, now: float) -> float | None:
    """Remaining time at the mean pace of the steps this process trained; None before the first one."""
    done = s.step - s.first_step
    if s.training_since is None or done <= 0:
        return None
    return (now - s.training_since) / done * max(0, s.steps - s.step)


def format_status(s: ProgressState, now: float, width: int = 120) -> str:
    """The terminal's status line, cut to `width` (a wrapped line could not be redrawn in place)."""
    frac = 0.0 if s.steps <= 0 else min(1.0, s.step / s.steps)
    filled = int(round(frac * BAR_WIDTH))
    eta = eta_seconds(s, now)
    parts = [
        f"step {s.step}/{s.steps} [{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {frac * 100:3.0f}%",
        f"elapsed {format_duration(now - s.started_at)} ETA {'--:--' if eta is None else format_duration(eta)}",
        f"{s.phase} {now - s.phase_since:.0f} s",
    ]
    if s.trainer:
        parts.append(f"trainer {s.trainer}")
    engines = format_engines(s.engines)
    parts.append(f"engines {s.engines_ready}/{s.engines_total}" + (f" {engines}" if engines else ""))
    if s.reward is not None:
        parts.append(f"reward {s.reward:.3f} v{s.weight_version} {s.samples_per_s:.1f} samples/s")
    line = " | ".join(parts)
    return line if len(line) <= width else line[: max(1, width - 1)] + "…"


def format_engines(engines: dict[str, str], each_up_to: int = 4) -> str:
    """`0:pinned v3 1:loading` for a few engines; `6 pinned v3, 2 loading` for more."""
    if len(engines) <= each_up_to:
        return " ".join(f"{slot}:{label}" for slot, label in sorted(engines.items(), key=lambda kv: _slot_key(kv[0])))
    counts: dict[str, int] = {}
    for label in engines.values():
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{n} {label}" for label, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _slot_key(slot: str) -> tuple[int, str]:
    return (int(slot), "") if slot.isdigit() else (1 << 30, slot)


# What an SGLang engine's log says while it starts: past these lines the model is being loaded.
_LOADING_MARKS = ("Load weight begin", "Memory baseline", "Loading safetensors", "Init torch distributed")


def startup_stage(log_tail: list[str]) -> str:
    """`loading` once the engine's log shows it loading the model, else `starting` (importing, parsing)."""
    return "loading" if any(mark in line for line in log_tail for mark in _LOADING_MARKS) else "starting"


def engine_label(state: str, stage: str | None, pinned_version: str | None) -> str:
    """One engine's label: starting/loading while it starts, healthy once it answers, pinned v<N> once
    the router sends it work at a version read back; dead and failed as they are."""
    if state == "starting":
        return stage or "starting"
    if state == "alive":
        return f"pinned v{pinned_version}" if pinned_version is not None else "healthy"
    return state


class ProgressReporter:
    def __init__(self, stream: TextIO | None = None, *, tty: bool | None = None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self._last_line = ""

    def _width(self) -> int:
        """The columns of the terminal written to (not $COLUMNS, which a parent may have left stale)."""
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns
        except (OSError, ValueError, AttributeError):
            columns = shutil.get_terminal_size((120, 24)).columns
        return max(20, columns - 1)

    def update(self, state: ProgressState) -> None:
        """Redraw the status line (TTY only; plain mode prints on events)."""
        if self.tty:
            line = format_status(state, time.monotonic(), self._width())
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
