"""The run summary written by `rlfleet run --summary PATH` (pure: built from recorded step results).

The per-step record (`StepRecord`, the summary's `records`) is the one record every tracker receives
too (`scalars()` names its series); events (`RunEvent`, the summary's `events`) are engine deaths,
recreations, heat pauses and watchdog strikes, each at the step in progress. Eval points are the
summary's `eval` list (scores by dataset at their step, seconds, skip reason).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.util.redact import redact


@dataclass
class StepRecord:
    step: int
    reward_mean: float
    weight_versions: list[str]  # versions of the samples the step trained on
    seconds: float
    samples: int
    engine_versions: dict[int, str] = field(default_factory=dict)  # slot -> version read back after the sync
    recovered_slots: list[int] = field(default_factory=list)  # slots recreated before this step's sync
    heat_paused: bool = False  # a heat-guard pause overlapped the step: its timing is not comparable
    sync: dict[str, Any] = field(default_factory=dict)  # the weight sync: mode, seconds, phases, fallback, checksums
    loss: float | None = None  # the trainer's loss on the step's batch
    reward_std: float | None = None
    kl_ref: float | None = None  # KL to the reference policy (only with trainer.klCoef > 0)
    clip_fraction: float | None = None  # response tokens whose ratio was clipped
    grad_norm: float | None = None
    response_length_mean: float | None = None  # response tokens per sample
    tokens: int = 0  # response tokens trained on
    staleness: dict[str, int] = field(default_factory=dict)  # steps behind the trainer -> samples
    stale_groups_dropped: int = 0
    samples_per_s: float | None = None  # samples trained / step seconds
    tokens_per_s: float | None = None
    phases: dict[str, float] = field(default_factory=dict)  # PHASES -> seconds
    ended_at: float | None = None  # seconds since the run started


# The phases of a step, in order: waiting for fresh-enough rollout groups, the optimizer step, waiting
# for the last broadcast step's snapshot (written beside this step) to free the buffer, the snapshot
# export, the weight sync (recovery, load, read-back), the time evaluation held the loop (copying
# weights, or backpressure), writing a checkpoint's in-memory copy.
PHASES = ("rollout_wait", "train", "snapshot_wait", "export", "weight_sync", "eval_held", "checkpoint")

# The record's numeric fields a tracker plots, under "train/<field>"; phases under "time/<phase>".
SERIES_FIELDS = ("reward_mean", "reward_std", "loss", "kl_ref", "clip_fraction", "grad_norm",
                 "response_length_mean", "tokens", "samples", "stale_groups_dropped", "samples_per_s",
                 "tokens_per_s", "seconds")


@dataclass
class RunEvent:
    """Something that happened to the fleet, at the step in progress (0: before the first step)."""

    kind: str  # one of EVENT_KINDS
    step: int
    at: float  # seconds since the run started
    slot: str | None = None
    detail: str = ""


EVENT_KINDS = ("engine_dead", "engine_recreated", "heat_pause", "heat_resume", "watchdog_strike", "router_event",
               "fleet_resized")


def record_to_dict(s: StepRecord) -> dict[str, Any]:
    """The per-step record as the summary's `records` hold it (and a tracker receives it)."""
    def r(value: float | None, digits: int = 6) -> float | None:
        return None if value is None else round(value, digits)

    return {
        "step": s.step, "reward_mean": r(s.reward_mean), "reward_std": r(s.reward_std), "loss": r(s.loss, 8),
        "kl_ref": r(s.kl_ref, 8), "clip_fraction": r(s.clip_fraction), "grad_norm": r(s.grad_norm),
        "response_length_mean": r(s.response_length_mean), "tokens": s.tokens, "samples": s.samples,
        "weight_versions": {v: s.weight_versions.count(v) for v in sorted(set(s.weight_versions))},
        "staleness": dict(sorted(s.staleness.items(), key=lambda kv: int(kv[0]))),
        "stale_groups_dropped": s.stale_groups_dropped, "samples_per_s": r(s.samples_per_s, 3),
        "tokens_per_s": r(s.tokens_per_s, 3), "seconds": r(s.seconds, 3),
        "phases": {k: round(s.phases[k], 3) for k in PHASES if k in s.phases},
        "sync_mode": s.sync.get("mode"), "recovered_slots": list(s.recovered_slots), "heat_paused": s.heat_paused,
        "ended_at": r(s.ended_at, 3),
    }


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The series a tracker writes for one record (`record_to_dict`'s form), by name; None is left out."""
    out = {f"train/{k}": float(record[k]) for k in SERIES_FIELDS if record.get(k) is not None}
    out.update({f"time/{k}": float(v) for k, v in record.get("phases", {}).items()})
    out.update({f"staleness/{k}": float(v) for k, v in record.get("staleness", {}).items()})
    return out


def eval_scalars(point: dict[str, Any]) -> dict[str, float]:
    """The series of one settled eval point (the summary's `eval` form): scores by dataset, seconds."""
    if point.get("skipped"):
        return {}
    out = {f"eval/{name}": float(score) for name, score in point.get("scores", {}).items()}
    if point.get("seconds") is not None:
        out["eval/seconds"] = float(point["seconds"])
    return out


def reward_std(rewards: list[float]) -> float | None:
    """Population standard deviation of the step's rewards (None for no samples)."""
    if not rewards:
        return None
    mean = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))


def staleness_of(versions: list[str], current_step: int) -> dict[str, int]:
    """Steps behind the trainer -> samples, from the samples' weight versions."""
    out: dict[str, int] = {}
    for v in versions:
        key = str(max(0, current_step - int(v))) if v.isdigit() else v
        out[key] = out.get(key, 0) + 1
    return out


STEP_LINE_PHASES = ("rollout_wait", "train")  # every step has them: shown even at 0.00 s (a batch already waiting)


def format_phases(phases: dict[str, float]) -> str:
    """`rollout 1.2 s, train 0.8 s, ...` for the step line (other phases under 5 ms are left out)."""
    names = {"rollout_wait": "rollout", "train": "train", "snapshot_wait": "snapshot", "export": "export",
             "weight_sync": "sync", "eval_held": "eval", "checkpoint": "ckpt"}
    return ", ".join(f"{names[k]} {phases.get(k, 0.0):.2f} s" for k in PHASES
                     if k in STEP_LINE_PHASES or phases.get(k, 0.0) >= 0.005)


@dataclass
class RunSummary:
    steps_planned: int
    steps: list[StepRecord] = field(default_factory=list)
    engines_marked_dead: int = 0
    engines_recreated: int = 0
    wall_seconds: float = 0.0
    eval: list[dict[str, Any]] = field(default_factory=list)
    eval_snapshots_left: int | None = None
    failure: str | None = None
    router_restarts: dict[str, int] = field(default_factory=dict)  # fleet -> router restarts
    router_events: list[str] = field(default_factory=list)  # "<fleet>: <what happened>", in order
    rollout_attempts: dict[str, int] = field(default_factory=dict)  # attempt result -> count (ok, circuit_open, ...)
    # continued rollouts: requests, continuations, tokens_saved (spec.rollout.continuation)
    rollout_continuations: dict[str, int] = field(default_factory=dict)
    resumed_from: list[int] = field(default_factory=list)  # checkpoint steps the run resumed from, in order
    checkpoints: list[dict[str, Any]] = field(default_factory=list)  # step, loop_held_seconds, write_seconds
    events: list[RunEvent] = field(default_factory=list)
    tracking: dict[str, dict[str, Any]] = field(default_factory=dict)  # tracker -> written, dropped, failure

    def to_dict(self) -> dict[str, Any]:
        first, last = reward_means_first_last(self.steps)
        return {
            "steps_completed": len(self.steps),
            "steps_planned": self.steps_planned,
            "reward_mean_first": first,
            "reward_mean_last": last,
            "reward_mean_per_step": [round(s.reward_mean, 6) for s in self.steps],
            "engines_marked_dead": self.engines_marked_dead,
            "engines_recreated": self.engines_recreated,
            "weight_versions_per_step": {str(s.step): sorted(set(s.weight_versions)) for s in self.steps},
            "engine_versions_per_step": {str(s.step): {str(k): v for k, v in sorted(s.engine_versions.items())}
                                         for s in self.steps},
            "recovered_slots_per_step": {str(s.step): s.recovered_slots for s in self.steps if s.recovered_slots},
            "heat_paused_per_step": {str(s.step): s.heat_paused for s in self.steps},
            "weight_sync_per_step": {str(s.step): s.sync for s in self.steps if s.sync},
            "weight_sync_fallbacks": sum(1 for s in self.steps if s.sync.get("fallback")),
            "wall_seconds": round(self.wall_seconds, 3),
            "eval": self.eval,
            "eval_snapshots_left": self.eval_snapshots_left,
            "failure": redact(self.failure) if self.failure else self.failure,
            "router_restarts": dict(self.router_restarts),
            "router_events": list(self.router_events),
            "rollout_attempts": dict(self.rollout_attempts),
            "rollout_continuations": dict(self.rollout_continuations),
            "loss_per_step": {str(s.step): None if s.loss is None else round(s.loss, 8) for s in self.steps},
            "resumed_from": list(self.resumed_from),
            "checkpoints": list(self.checkpoints),
            "records": [record_to_dict(s) for s in self.steps],
            "events": [dataclasses.asdict(e) for e in self.events],
            "event_counts": {k: sum(1 for e in self.events if e.kind == k) for k in EVENT_KINDS},
            "eval_skips": _skips(self.eval),
            "tracking": {k: dict(v) for k, v in self.tracking.items()},
        }

    def write(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(path)


def _skips(points: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in points:
        if p.get("skipped"):
            out[p["skipped"]] = out.get(p["skipped"], 0) + 1
    return out


def reward_means_first_last(steps: list[StepRecord]) -> tuple[float | None, float | None]:
    """Mean reward over the first and the last 10% of steps (at least one step each)."""
    if not steps:
        return None, None
    k = max(1, math.ceil(len(steps) * 0.1))
    first = sum(s.reward_mean for s in steps[:k]) / k
    last = sum(s.reward_mean for s in steps[-k:]) / k
    return round(first, 6), round(last, 6)
