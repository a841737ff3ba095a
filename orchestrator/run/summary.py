"""The run summary written by `rlfleet run --summary PATH` (pure: built from recorded step results)."""
from __future__ import annotations

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
        }

    def write(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(path)


def reward_means_first_last(steps: list[StepRecord]) -> tuple[float | None, float | None]:
    """Mean reward over the first and the last 10% of steps (at least one step each)."""
    if not steps:
        return None, None
    k = max(1, math.ceil(len(steps) * 0.1))
    first = sum(s.reward_mean for s in steps[:k]) / k
    last = sum(s.reward_mean for s in steps[-k:]) / k
    return round(first, 6), round(last, 6)
