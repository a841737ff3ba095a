"""What a run report shows, read from a run summary (pure; the summary JSON `rlfleet run` writes).

Reads today's fields and the per-step record's (`records`: each step's `phases` in seconds; `events`:
engine deaths, recreations, heat pauses, watchdog strikes at their step) when the summary has them;
fields it does not know are ignored, so a newer summary still renders.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Step phases in stack order (the per-step record's names), then what the record's seconds leave over.
PHASES = ("rollout_wait", "train", "snapshot_wait", "export", "weight_sync", "eval_held", "checkpoint")
OTHER = "other"


@dataclass(frozen=True)
class Event:
    step: int
    kind: str  # engine_dead, engine_recreated, heat_pause, sync_fallback, checkpoint, resumed, ...
    slot: str | None = None
    detail: str = ""


@dataclass
class Report:
    title: str
    steps: list[int] = field(default_factory=list)
    reward: list[tuple[int, float]] = field(default_factory=list)  # (step, mean reward)
    eval_scores: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # dataset -> (step, score)
    eval_skips: list[tuple[int, str]] = field(default_factory=list)  # (step, reason)
    step_times: list[tuple[int, dict[str, float]]] = field(default_factory=list)  # (step, part -> seconds)
    time_parts: list[str] = field(default_factory=list)  # the parts of step_times, in stack order
    time_source: str = ""  # what the breakdown is: "step phases" or "weight sync phases"
    events: list[Event] = field(default_factory=list)
    weight_versions: list[tuple[int, list[str]]] = field(default_factory=list)  # versions trained on per step
    engine_versions: list[tuple[int, dict[str, str]]] = field(default_factory=list)  # slot -> version read back
    router_events: list[str] = field(default_factory=list)
    facts: list[tuple[str, str]] = field(default_factory=list)  # headline figures, in order


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _step_keys(mapping: Any) -> list[int]:
    return sorted(int(k) for k in mapping) if isinstance(mapping, dict) else []


def from_summary(data: dict[str, Any], title: str = "rlfleet run") -> Report:
    """The report of one summary (a dict as the summary JSON holds it)."""
    report = Report(title=title)
    records = [r for r in data.get("records") or [] if isinstance(r, dict) and "step" in r]
    if records:
        report.steps = [int(r["step"]) for r in records]
        report.reward = [(int(r["step"]), float(r["reward_mean"])) for r in records
                         if _num(r.get("reward_mean")) is not None]
    else:
        report.steps = _step_keys(data.get("weight_versions_per_step"))
        rewards = data.get("reward_mean_per_step") or []
        report.reward = [(step, float(r)) for step, r in zip(report.steps, rewards, strict=False)
                         if _num(r) is not None]
    _eval(report, data.get("eval") or [])
    _step_times(report, records, data.get("weight_sync_per_step") or {})
    _events(report, data)
    for step in _step_keys(data.get("weight_versions_per_step")):
        versions = data["weight_versions_per_step"][str(step)]
        report.weight_versions.append((step, [str(v) for v in versions]))
    for step in _step_keys(data.get("engine_versions_per_step")):
        engines = data["engine_versions_per_step"][str(step)]
        report.engine_versions.append((step, {str(k): str(v) for k, v in engines.items()}))
    report.router_events = [str(e) for e in data.get("router_events") or []]
    report.facts = _facts(data, report)
    return report


def _eval(report: Report, points: list[Any]) -> None:
    for point in points:
        if not isinstance(point, dict) or "step" not in point:
            continue
        if point.get("skipped"):
            report.eval_skips.append((int(point["step"]), str(point["skipped"])))
            continue
        for dataset, score in sorted((point.get("scores") or {}).items()):
            if _num(score) is not None:
                report.eval_scores.setdefault(dataset, []).append((int(point["step"]), float(score)))


def _step_times(report: Report, records: list[dict[str, Any]], syncs: dict[str, Any]) -> None:
    timed = [r for r in records if isinstance(r.get("phases"), dict) and r["phases"]]
    if timed:
        report.time_source = "step phases"
        parts: list[str] = [p for p in PHASES if any(p in r["phases"] for r in timed)]
        parts += sorted({p for r in timed for p in r["phases"]} - set(parts))
        for r in timed:
            times = {p: float(r["phases"][p]) for p in parts if _num(r["phases"].get(p)) is not None}
            total = _num(r.get("seconds"))
            if total is not None and total - sum(times.values()) > 0.0005:
                times[OTHER] = total - sum(times.values())
            report.step_times.append((int(r["step"]), times))
        if any(OTHER in t for _, t in report.step_times):
            parts.append(OTHER)
        report.time_parts = parts
        return
    # Today's summary: each step's weight sync and its phases (validate, load, read_back, ...).
    report.time_source = "weight sync phases"
    parts = []
    for step in _step_keys(syncs):
        sync = syncs[str(step)]
        phases = {f"sync {k}": float(v) for k, v in (sync.get("phases") or {}).items() if _num(v) is not None}
        total = _num(sync.get("seconds"))
        if not phases and total is not None:
            phases = {"weight_sync": total}
        elif total is not None and total - sum(phases.values()) > 0.0005:
            phases[f"sync {OTHER}"] = total - sum(phases.values())
        parts += [p for p in phases if p not in parts]
        report.step_times.append((step, phases))
    report.time_parts = sorted(parts, key=lambda p: p == f"sync {OTHER}")  # what is left over on top


def _events(report: Report, data: dict[str, Any]) -> None:
    logged = [e for e in data.get("events") or [] if isinstance(e, dict) and "kind" in e]
    events = [Event(int(e.get("step") or 0), str(e["kind"]), None if e.get("slot") is None else str(e["slot"]),
                    str(e.get("detail") or "")) for e in logged]
    if not logged:  # today's summary: what each step says happened
        for step in _step_keys(data.get("recovered_slots_per_step")):
            for slot in data["recovered_slots_per_step"][str(step)]:
                events.append(Event(step, "engine_recreated", str(slot)))
        for step in _step_keys(data.get("heat_paused_per_step")):
            if data["heat_paused_per_step"][str(step)]:
                events.append(Event(step, "heat_pause"))
    for step in _step_keys(data.get("weight_sync_per_step")):
        fallback = (data["weight_sync_per_step"][str(step)] or {}).get("fallback")
        if fallback:
            events.append(Event(step, "sync_fallback", detail=str(fallback)))
    for point in data.get("checkpoints") or []:
        if isinstance(point, dict) and "step" in point:
            events.append(Event(int(point["step"]), "checkpoint"))
    for step in data.get("resumed_from") or []:
        events.append(Event(int(step), "resumed"))
    report.events = sorted(events, key=lambda e: (e.step, e.kind, e.slot or ""))


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _facts(data: dict[str, Any], report: Report) -> list[tuple[str, str]]:
    facts = [("steps", f"{_fmt(data.get('steps_completed', len(report.steps)))} / {_fmt(data.get('steps_planned'))}"),
             ("reward (first 10% -> last 10%)",
              f"{_fmt(data.get('reward_mean_first'))} -> {_fmt(data.get('reward_mean_last'))}"),
             ("wall seconds", _fmt(data.get("wall_seconds"))),
             ("engines marked dead / recreated",
              f"{_fmt(data.get('engines_marked_dead'))} / {_fmt(data.get('engines_recreated'))}"),
             ("eval points scored", f"{len({s for pts in report.eval_scores.values() for s, _ in pts})}"
                                    f" (skipped {len(report.eval_skips)})")]
    if data.get("failure"):
        facts.append(("failure", str(data["failure"])))
    return facts
