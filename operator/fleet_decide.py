"""What one reconcile of a fleet must do, decided from cluster state alone. Pure: no I/O, no clock.

`decide_fleet_actions(spec, pods, status, ...)` takes the fleet spec, the engine pods observed now and
the fleet's last written status, and returns the new status plus the pods to create and delete, the
Events to record and when to look again; `decide_network_policy` converges the fleet's engine
NetworkPolicy (create when missing, restore when changed, delete when switched off). Everything needed
to survive an operator restart lives in the cluster: the slot's restart count in
`status.engines[].restarts` and in each pod's `rlfleet.io/restarts` annotation; the backoff clock in
`status.engines[].lastFailure.time`.

Slot states: Pending (pod created, not running) -> Starting (running, not ready) -> Ready; a failure
makes it Dead (waiting out the backoff) -> Recreating (old pod being deleted / new one created) ->
Pending ...; a slot out of budget is Failed and left alone, its pod kept for diagnosis.

A pod is dead when it terminated (phase Failed/Succeeded or a terminated container), cannot start
(configuration errors), did not become ready within `health.startupTimeoutSeconds`, or when the
orchestrator marked it with the `rlfleet.io/dead` annotation. A pod that vanished while Starting or
Ready counts as a failure too. Recreation is delete-then-create under the slot's stable name, so no
two pods ever serve one slot, whatever the operator's restarts or stale caches.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfleet.crds.fleet_specs import FleetSpec
from rlfleet.kube.conditions import clip, condition, find, iso, parse_time
from rlfleet.kube.pods import FAILURE_MESSAGE_MAX, Failure, PodView, int_or, view_pod
from rlfleet.operator import builders as b


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class FleetPlan:
    status: dict
    create: list[tuple[int, int]] = field(default_factory=list)  # (slot, restarts)
    delete: list[tuple[str, str]] = field(default_factory=list)  # (pod name, uid)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None


def backoff_s(spec: FleetSpec, restarts_done: int) -> float:
    r = spec.recovery
    return min(r.backoff_max_seconds, r.backoff_base_seconds * (2 ** restarts_done))


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else "..." + text[-(limit - 3):]


def decide_fleet_actions(spec: FleetSpec, pods: list[dict], status: dict | None, *, fleet_name: str, now: float,
                         generation: int | None = None) -> FleetPlan:
    """One level-based reconcile of a fleet: new status, pods to create/delete, events, requeue time."""
    status = status or {}
    old_slots = {e["slot"]: e for e in status.get("engines") or [] if isinstance(e.get("slot"), int)}
    total = int_or(status.get("restarts"))
    plan = FleetPlan(status={})
    views = [view_pod(p) for p in pods]
    by_slot: dict[int, PodView] = {}
    for v in views:
        if v.slot is not None and v.slot < spec.replicas and v.name == b.engine_pod_name(fleet_name, v.slot):
            by_slot[v.slot] = v
        elif not v.terminating:  # scaled away, or not ours to keep
            plan.delete.append((v.name, v.uid))
            if v.slot is not None and v.slot >= spec.replicas:
                plan.events.append(Event("Normal", "ScaledDown", f"deleting {v.name}: slot {v.slot} >= replicas"))

    def wake_in(seconds: float) -> None:
        plan.requeue_after = seconds if plan.requeue_after is None else min(plan.requeue_after, seconds)

    engines: list[dict] = []
    new_slots: list[int] = []
    for slot in range(spec.replicas):
        old = old_slots.get(slot, {})
        pod = by_slot.get(slot)
        state = old.get("state", "Pending") if old else "New"
        restarts = max(int_or(old.get("restarts")), pod.restarts if pod else 0)
        last_failure = old.get("lastFailure")
        entry: dict = {"slot": slot, "pod": b.engine_pod_name(fleet_name, slot)}

        if state == "Failed":
            pass  # out of budget: keep the pod (and its logs) for diagnosis
        elif pod and pod.terminating:
            state = "Recreating"
            wake_in(2.0)
        elif pod and pod.restarts < restarts:
            plan.delete.append((pod.name, pod.uid))  # left over from a recreation already counted
            state = "Recreating"
        else:
            failure = pod.failure if pod else None
            if pod and failure is None and not pod.ready and pod.created is not None:
                age = now - pod.created
                if age > spec.health.startup_timeout_seconds:
                    failure = Failure("StartupTimeout", f"not ready {int(age)} s after creation "
                                      f"(health.startupTimeoutSeconds {spec.health.startup_timeout_seconds:g})")
                else:
                    wake_in(spec.health.startup_timeout_seconds - age + 1)
            if pod is None and state in ("Starting", "Ready"):
                failure = Failure("PodDeleted", f"pod {entry['pod']} disappeared")
            if failure is None and state != "Dead":
                if pod is None:
                    plan.create.append((slot, restarts))
                    if state == "New":
                        new_slots.append(slot)
                    state = "Pending"
                else:
                    state = "Ready" if pod.ready else ("Starting" if pod.phase == "Running" else "Pending")
            else:
                if state != "Dead" and failure is not None:  # a failure seen for the first time
                    last_failure = {"reason": failure.reason, "message": clip(failure.message, FAILURE_MESSAGE_MAX),
                                    "time": iso(now)}
                    if failure.exit_code is not None:
                        last_failure["exitCode"] = failure.exit_code
                    code = f" (exit code {failure.exit_code})" if failure.exit_code is not None else ""
                    plan.events.append(Event("Warning", "EngineDead", f"slot {slot} ({entry['pod']}) "
                                             f"{failure.reason}{code}: {_short(failure.message)}"))
                    state = "Dead"
                state, total, restarts = _recover(spec, plan, slot, entry["pod"], pod, state, restarts, total,
                                                  last_failure, now, wake_in)
        entry["state"] = state
        entry["restarts"] = restarts
        if pod and pod.pod_ip and state not in ("Recreating",):
            entry["url"] = f"http://{pod.pod_ip}:{spec.engine.port}"
        if pod and pod.weight_version and state not in ("Recreating",):
            entry["weightVersion"] = pod.weight_version
        if last_failure:
            entry["lastFailure"] = last_failure
        engines.append(entry)

    if new_slots:  # one Event for a whole scale-up, not one per pod
        what = f"slot {new_slots[0]}" if len(new_slots) == 1 else f"slots {new_slots[0]}-{new_slots[-1]}"
        plan.events.insert(0, Event("Normal", "CreatingEngines", f"creating {len(new_slots)} engine pod(s): {what}"))
    plan.status = fleet_status(spec, engines, total, status.get("conditions"), fleet_name=fleet_name, now=now,
                               generation=generation, existing=sum(1 for s in by_slot.values() if not s.terminating))
    for cond in plan.status["conditions"]:
        old_cond = find(status.get("conditions"), cond["type"])
        if cond["type"] == "Failed" and cond["status"] == "True" and not (old_cond and old_cond["status"] == "True"):
            plan.events.append(Event("Warning", cond["reason"], _short(cond["message"], 1000)))
    return plan


def _recover(spec: FleetSpec, plan: FleetPlan, slot: int, pod_name: str, pod: PodView | None, state: str,
             restarts: int, total: int, last_failure: dict | None, now: float, wake_in) -> tuple[str, int, int]:
    """A dead slot: recreate it when its backoff has passed, or fail it when out of budget."""
    rec = spec.recovery
    if restarts >= rec.max_restarts_per_engine:
        plan.events.append(Event("Warning", "RestartBudgetExhausted",
                                 f"slot {slot} failed after {restarts} restarts (maxRestartsPerEngine "
                                 f"{rec.max_restarts_per_engine}); not recreating it"))
        return "Failed", total, restarts
    if total >= rec.max_restarts_per_run:
        plan.events.append(Event("Warning", "RestartBudgetExhausted",
                                 f"slot {slot} not recreated: the fleet used its {rec.max_restarts_per_run} "
                                 "restarts (maxRestartsPerRun)"))
        return "Failed", total, restarts
    failed_at = parse_time((last_failure or {}).get("time")) or now
    due = failed_at + backoff_s(spec, restarts)
    if now < due:
        wake_in(due - now)
        return "Dead", total, restarts
    restarts, total = restarts + 1, total + 1
    plan.events.append(Event("Normal", "RecreatingEngine", f"recreating slot {slot} ({pod_name}), restart {restarts} "
                             f"of {rec.max_restarts_per_engine}"))
    if pod is not None:
        plan.delete.append((pod.name, pod.uid))
    else:
        plan.create.append((slot, restarts))
    return "Recreating", total, restarts


def fleet_status(spec: FleetSpec, engines: list[dict], total_restarts: int, previous_conditions: list[dict] | None,
                 *, fleet_name: str, now: float, generation: int | None, existing: int) -> dict:
    """The fleet's status object: counts, slots and the four conditions."""
    replicas = spec.replicas
    ready = sum(1 for e in engines if e["state"] == "Ready")
    failed = [e for e in engines if e["state"] == "Failed"]
    down = [e for e in engines if e["state"] in ("Dead", "Recreating")]
    starting = [e for e in engines if e["state"] in ("Pending", "Starting", "Recreating")]
    need = max(spec.min_ready_engines, 1) if replicas else 0
    versions = {e.get("weightVersion") for e in engines if e["state"] == "Ready"}

    fleet_failed = bool(failed) and replicas - len(failed) < need
    if fleet_failed:
        worst = failed[-1]
        lf = worst.get("lastFailure") or {}
        code = f", exit code {lf['exitCode']}" if lf.get("exitCode") is not None else ""
        failed_msg = (f"engine slot {worst['slot']} failed {worst['restarts'] + 1} times "
                      f"(maxRestartsPerEngine {spec.recovery.max_restarts_per_engine}, "
                      f"{total_restarts} of maxRestartsPerRun {spec.recovery.max_restarts_per_run} used); "
                      f"last failure {lf.get('reason', 'Unknown')}{code}:\n{lf.get('message', '')}")
        failed_reason = "EngineCrashLoop" if lf.get("reason") in ("Crashed", "Exited") else "EngineFailed"
    else:
        failed_msg, failed_reason = f"{len(failed)} of {replicas} slots failed; {need} needed", "AsExpected"

    ok = ready >= need
    degraded_slots = failed + down
    conditions = [
        condition("Ready", ok, "EnginesReady" if ok else "EnginesNotReady",
                  f"{ready}/{replicas} engines ready (minReadyEngines {spec.min_ready_engines})",
                  now=now, previous=previous_conditions, generation=generation),
        condition("Progressing", bool(starting) and not fleet_failed,
                  "EnginesStarting" if starting else "Stable",
                  ", ".join(f"slot {e['slot']} {e['state']}" for e in starting) or "all slots settled",
                  now=now, previous=previous_conditions, generation=generation),
        condition("Degraded", bool(degraded_slots), "EnginesDown" if degraded_slots else "AsExpected",
                  "; ".join(f"slot {e['slot']} {e['state']}: {(e.get('lastFailure') or {}).get('reason', '')}"
                            for e in degraded_slots) or "no slot down",
                  now=now, previous=previous_conditions, generation=generation),
        condition("Failed", fleet_failed, failed_reason, failed_msg,
                  now=now, previous=previous_conditions, generation=generation),
    ]
    out = {
        "replicas": existing,
        "readyReplicas": ready,
        "selector": b.engine_selector(fleet_name),
        "restarts": total_restarts,
        "engines": engines,
        "conditions": conditions,
    }
    if len(versions) == 1 and None not in versions:
        out["weightVersion"] = versions.pop()
    if generation is not None:
        out["observedGeneration"] = generation
    return out


@dataclass(frozen=True)
class ChildAction:
    """One write to a fleet's child object: create `obj`, patch its spec to `obj`'s, or delete it."""

    verb: str  # create | patch | delete
    obj: dict


def decide_network_policy(fleet: dict, current: dict | None, *, enabled: bool,
                          metrics_from: Sequence[dict] = ()) -> ChildAction | None:
    """Converge the fleet's engine NetworkPolicy: exists and matches when enabled, absent when not.

    `current` is the policy observed now (labelled for this fleet), None when there is none.
    """
    if not enabled:
        return ChildAction("delete", current) if current and not current["metadata"].get("deletionTimestamp") else None
    desired = b.build_engine_network_policy(fleet, metrics_from=metrics_from)
    if current is None:
        return ChildAction("create", desired)
    if current["metadata"].get("deletionTimestamp"):
        return None  # being deleted: created again once it is gone
    if current.get("spec") != desired["spec"]:
        return ChildAction("patch", desired)
    return None


def covers(current: Any, desired: Any) -> bool:
    """`current` holds everything `desired` sets (the API server adds defaults we never wrote). Pure."""
    if isinstance(desired, dict):
        return isinstance(current, dict) and all(covers(current.get(k), v) for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(current, list) and len(current) == len(desired)
                and all(covers(c, d) for c, d in zip(current, desired, strict=True)))
    return current == desired


def decide_router_deployment(fleet: dict, current: dict | None) -> ChildAction | None:
    """Create the fleet's router Deployment, or roll it when its pod template no longer matches the
    fleet's router spec (image, policy, port, health settings). The trainer follows the new pod."""
    desired = b.build_router_deployment(fleet)
    if current is None:
        return ChildAction("create", desired)
    if current["metadata"].get("deletionTimestamp"):
        return None
    if not covers(current.get("spec", {}).get("template"), desired["spec"]["template"]):
        return ChildAction("patch", desired)
    return None
