"""Evaluation policy, pure: which steps are evaluated, admission under maxInFlight, snapshot ownership,
dataset scoring and what a settled point reports.

The dispatcher (eval_dispatcher.py) applies these decisions; nothing here does I/O or reads a clock.
"""
from __future__ import annotations

import enum
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Skips whose snapshot is garbage: deleted at once instead of joining the kept, consumed ones.
UNUSABLE_SNAPSHOT_REASONS = frozenset({"export_failed", "ckpt_missing"})


# --- schedule ------------------------------------------------------------------------------------------

def is_eval_step(step: int, *, interval: int, final_step: int, before_train: bool) -> bool:
    """Step 0 is the initial model (only with evalBeforeTrain); the final step is always evaluated."""
    if interval < 1:
        raise ValueError(f"interval must be >= 1, got {interval}")
    if step == 0:
        return before_train
    return step == final_step or step % interval == 0


def planned_eval_steps(*, interval: int, final_step: int, before_train: bool) -> list[int]:
    return [s for s in range(final_step + 1) if is_eval_step(s, interval=interval, final_step=final_step,
                                                             before_train=before_train)]


# --- admission -----------------------------------------------------------------------------------------

class Admission(enum.StrEnum):
    START = "start"  # room for another point
    WAIT = "wait"  # backpressure: wait for the oldest pending point, then ask again
    SKIP_BUSY = "skip_busy"  # overflowPolicy skip: record the point as skipped "busy"


def admit(pending: int, *, max_in_flight: int, overflow_policy: str, force: bool = False) -> Admission:
    """What to do with a new point while `pending` points are unsettled. A forced point (the final step)
    is never skipped: it waits like backpressure."""
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    if overflow_policy not in ("backpressure", "skip"):
        raise ValueError(f"overflow_policy must be backpressure or skip, got {overflow_policy!r}")
    if pending < max_in_flight:
        return Admission.START
    if overflow_policy == "skip" and not force:
        return Admission.SKIP_BUSY
    return Admission.WAIT


# --- snapshot ownership --------------------------------------------------------------------------------

class SnapshotOwnershipError(RuntimeError):
    """A snapshot was taken twice or retired without being owned: a dispatcher bug, never ignored."""


@dataclass
class SnapshotLedger:
    """Single owner of the eval snapshots: each exported snapshot is retired exactly once when its point
    settles; the `keep` newest consumed ones stay, older ones (and unusable ones at once) are deleted."""

    keep: int
    owned: dict[int, str] = field(default_factory=dict)  # step -> dir, exported and not yet settled
    consumed: deque[tuple[int, str]] = field(default_factory=deque)  # settled and kept, oldest first
    taken: int = 0
    retired: int = 0

    def __post_init__(self) -> None:
        if self.keep < 0:
            raise ValueError(f"keep must be >= 0, got {self.keep}")

    def take(self, step: int, directory: str) -> None:
        if step in self.owned:
            raise SnapshotOwnershipError(f"the snapshot of step {step} is already owned ({self.owned[step]})")
        self.owned[step] = directory
        self.taken += 1

    def retire(self, step: int, *, usable: bool = True) -> list[str]:
        """Settle the snapshot of `step`; returns the directories to delete now."""
        try:
            directory = self.owned.pop(step)
        except KeyError:
            raise SnapshotOwnershipError(f"step {step} has no owned snapshot to retire") from None
        self.retired += 1
        delete: list[str] = []
        if usable:
            self.consumed.append((step, directory))
        else:
            delete.append(directory)
        while len(self.consumed) > self.keep:
            delete.append(self.consumed.popleft()[1])
        return delete

    @property
    def kept(self) -> list[str]:
        return [d for _, d in self.consumed]

    @property
    def balanced(self) -> bool:
        """Every snapshot taken has been retired (true after a drain)."""
        return not self.owned and self.taken == self.retired


# --- scoring -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SampleOutcome:
    """One eval sample as the engine answered it and the reward function scored it."""

    reward: float | None  # None: the reward function failed (scored as 0)
    response_tokens: int
    finish: str | None  # SGLang finish_reason.type: stop, length, abort
    weight_version: str | None  # meta_info.weight_version of the answer


@dataclass(frozen=True)
class DatasetScore:
    name: str
    score: float  # mean reward (a failed reward counts 0)
    samples: int = 0
    response_length_mean: float | None = None
    truncated_ratio: float | None = None
    none_reward_ratio: float | None = None
    mixed_version_ratio: float | None = None  # share of samples not generated by the pinned version

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items() if k != "name"}


def score_dataset(name: str, outcomes: Sequence[SampleOutcome], expected_version: str) -> DatasetScore:
    if not outcomes:
        raise ValueError(f"dataset {name}: no samples to score")
    n = len(outcomes)
    return DatasetScore(
        name=name,
        score=sum(o.reward or 0.0 for o in outcomes) / n,
        samples=n,
        response_length_mean=sum(o.response_tokens for o in outcomes) / n,
        truncated_ratio=sum(1 for o in outcomes if o.finish == "length") / n,
        none_reward_ratio=sum(1 for o in outcomes if o.reward is None) / n,
        mixed_version_ratio=sum(1 for o in outcomes if o.weight_version != expected_version) / n,
    )


def overall_mixed_version_ratio(scores: Iterable[DatasetScore]) -> float | None:
    """Sample-weighted over the datasets that know it; None when none does (an external evaluator)."""
    known = [(s.mixed_version_ratio, s.samples) for s in scores if s.mixed_version_ratio is not None and s.samples]
    total = sum(samples for _, samples in known)
    if not total:
        return None
    return sum(ratio * samples for ratio, samples in known) / total


# --- a settled point -----------------------------------------------------------------------------------

@dataclass
class EvalPoint:
    """One evaluation point as recorded at its intended step, whether scored or skipped."""

    step: int
    posture: str
    weight_version: str | None = None  # the version every engine reported (None when skipped)
    datasets: dict[str, DatasetScore] = field(default_factory=dict)
    skipped: str | None = None
    detail: str = ""  # why it was skipped (the error), for logs and the summary
    lag_steps: int | None = None  # training steps taken by the time the point settled
    seconds: float | None = None  # evaluation (pin + generate + score), after export
    export_seconds: float | None = None  # writing the snapshot, beside training
    queued_seconds: float | None = None  # waiting for the export and a free evaluation slot
    engine_versions: dict[str, str] = field(default_factory=dict)  # engine -> version read back

    @property
    def scores(self) -> dict[str, float]:
        return {name: s.score for name, s in self.datasets.items()}

    @property
    def mixed_version_ratio(self) -> float | None:
        return overall_mixed_version_ratio(self.datasets.values())

    def to_summary(self) -> dict[str, Any]:
        def r(value: float | None) -> float | None:
            return None if value is None else round(value, 6)

        return {
            "step": self.step,
            "weight_version": self.weight_version,
            "posture": self.posture,
            "scores": {k: r(v) for k, v in sorted(self.scores.items())},
            "skipped": self.skipped,
            "mixed_version_ratio": r(self.mixed_version_ratio),
            "lag_steps": self.lag_steps,
            "seconds": r(self.seconds),
            "export_seconds": r(self.export_seconds),
            "queued_seconds": r(self.queued_seconds),
            "datasets": {name: s.to_dict() for name, s in sorted(self.datasets.items())},
            "engine_versions": dict(sorted(self.engine_versions.items())),
            **({"detail": self.detail} if self.detail else {}),
        }


def skip_counts(points: Iterable[EvalPoint]) -> dict[str, int]:
    return dict(Counter(p.skipped for p in points if p.skipped))


def last_eval_fields(points: Sequence[EvalPoint]) -> dict[str, Any] | None:
    """The fields of TrainingRun status.lastEval: the newest point by step, and skips so far by reason."""
    if not points:
        return None
    newest = max(points, key=lambda p: p.step)
    return {
        "step": newest.step,
        "weight_version": newest.weight_version,
        "scores": newest.scores,
        "skipped_reason": newest.skipped,
        "skipped": skip_counts(points),
    }


def summarize_points(points: Iterable[EvalPoint]) -> list[dict[str, Any]]:
    return [p.to_summary() for p in sorted(points, key=lambda p: p.step)]


def mapping_scores(raw: Mapping[str, Any]) -> dict[str, DatasetScore]:
    """An external evaluator's plain {dataset: score} mapping as dataset scores (no sample details)."""
    out: dict[str, DatasetScore] = {}
    for name, value in raw.items():
        if isinstance(value, DatasetScore):
            out[str(name)] = value
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"score of dataset {name!r} must be a number or a DatasetScore, got {value!r}")
        out[str(name)] = DatasetScore(name=str(name), score=float(value))
    return out
