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
orchestrator marked it dead in the fleet's `status.orchestrator.engines` (`rlfleet.kube.marks`). A pod
that vanished while Starting or Ready counts as a failure too. Recreation is delete-then-create under
the slot's stable name, so no two pods ever serve one slot, whatever the operator's restarts or stale
caches.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from rlfleet.crds import reasons
from rlfleet.crds.fleet_specs import FleetSpec, run_only_fields_set
from rlfleet.crds.status import (
    Condition,
    EngineSlotStatus,
    FailureStatus,
    FleetStatus,
    SlotState,
    ready_text,
    status_dump,
)
from rlfleet.kube.conditions import clip, condition, find, iso, parse_time
from rlfleet.kube.marks import engine_marks
from rlfleet.kube.pods import FAILURE_MESSAGE_MAX, Failure, PodView, int_or, view_marked
from rlfleet.operator import builders as b
from rlfleet.operator.engine_update_decide import SlotPod, outdated, slots_to_replace
from rlfleet.policy.recovery import GiveUp, backoff_delay, decide_dead_slot


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
    # resourceVersions the pass's own status writes replaced (operator/staleness.py)
    superseded_versions: frozenset[str] = frozenset()
    recreated: list[int] = field(default_factory=list)  # slots recreated by this reconcile
    given_up: list[int] = field(default_factory=list)  # slots given up by this reconcile

    def wake_in(self, seconds: float) -> None:
        """Look again within `seconds` (the earliest of all requests wins)."""
        self.requeue_after = seconds if self.requeue_after is None else min(self.requeue_after, seconds)


def backoff_s(spec: FleetSpec, restarts_done: int) -> float:
    """The fleet's backoff before a slot's next recreation (the one policy, `recovery.backoff_delay`)."""
    return backoff_delay(restarts_done, spec.recovery)


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else "..." + text[-(limit - 3):]


def decide_fleet_actions(spec: FleetSpec, pods: list[dict], status: dict | None, *, fleet_name: str, now: float,
                         generation: int | None = None, engine_spec: str | None = None) -> FleetPlan:
    """One level-based reconcile of a fleet: new status, pods to create/delete, events, requeue time.

    Composes the policies below: scale-down (which pods belong to a slot), per slot its state with
    the startup timeout and the restart policy, the replacement of pods built from an earlier engine
    spec (`engine_spec`: the digest of the fleet's; None: none are replaced, as for a run's fleet), then
    the fleet's conditions.
    """
    status = status or {}
    old_slots = {e["slot"]: e for e in status.get("engines") or [] if isinstance(e.get("slot"), int)}
    total = int_or(status.get("restarts"))
    plan = FleetPlan(status={})
    marks = engine_marks(status)
    by_slot = scale_down(spec, [view_marked(p, marks) for p in pods], plan, fleet_name=fleet_name)
    engines: list[EngineSlotStatus] = []
    for slot in range(spec.replicas):
        engine, total = decide_slot(spec, slot, old_slots.get(slot), by_slot.get(slot), total, plan,
                                    fleet_name=fleet_name, now=now)
        engines.append(engine)
    stale = replace_outdated(engines, by_slot, engine_spec, plan) if engine_spec is not None else 0
    new_slots = [slot for slot in range(spec.replicas) if slot not in old_slots and slot not in by_slot]
    if new_slots:  # one Event for a whole scale-up, not one per pod
        what = f"slot {new_slots[0]}" if len(new_slots) == 1 else f"slots {new_slots[0]}-{new_slots[-1]}"
        plan.events.insert(0, Event("Normal", reasons.CREATING_ENGINES,
                                    f"creating {len(new_slots)} engine pod(s): {what}"))
    plan.status = fleet_status(spec, engines, total, status.get("conditions"), fleet_name=fleet_name, now=now,
                               generation=generation, existing=sum(1 for s in by_slot.values() if not s.terminating),
                               outdated=stale)
    plan.events.extend(failed_events(plan.status["conditions"], status.get("conditions")))
    return plan


def scale_down(spec: FleetSpec, views: list[PodView], plan: FleetPlan, *, fleet_name: str) -> dict[int, PodView]:
    """The pod of each slot; pods of slots scaled away, and strays, are deleted."""
    by_slot: dict[int, PodView] = {}
    for v in views:
        if v.slot is not None and v.slot < spec.replicas and v.name == b.engine_pod_name(fleet_name, v.slot):
            by_slot[v.slot] = v
        elif not v.terminating:  # scaled away, or not ours to keep
            plan.delete.append((v.name, v.uid))
            if v.slot is not None and v.slot >= spec.replicas:
                plan.events.append(Event("Normal", reasons.SCALED_DOWN,
                                         f"deleting {v.name}: slot {v.slot} >= replicas"))
    return by_slot


def decide_slot(spec: FleetSpec, slot: int, old: dict | None, pod: PodView | None, total: int, plan: FleetPlan,
                *, fleet_name: str, now: float) -> tuple[EngineSlotStatus, int]:
    """One slot's state from its last status entry and its pod; returns it and the fleet's restarts."""
    old = old or {}
    pod_name = b.engine_pod_name(fleet_name, slot)
    state = old.get("state", "Pending") if old else "New"
    restarts = max(int_or(old.get("restarts")), pod.restarts if pod else 0)
    last_failure = FailureStatus.model_validate(old["lastFailure"]) if old.get("lastFailure") else None

    if state == "Failed":
        pass  # out of budget: keep the pod (and its logs) for diagnosis
    elif pod and pod.terminating:
        state = "Recreating"
        plan.wake_in(2.0)
    elif pod and pod.restarts < restarts:
        plan.delete.append((pod.name, pod.uid))  # left over from a recreation already counted
        state = "Recreating"
    else:
        failure = slot_failure(spec, pod, state, pod_name, plan, now=now)
        if failure is None and state != "Dead":
            if pod is None:
                plan.create.append((slot, restarts))
                state = "Pending"
            else:
                state = "Ready" if pod.ready else ("Starting" if pod.phase == "Running" else "Pending")
        else:
            if state != "Dead" and failure is not None:  # a failure seen for the first time
                last_failure = failure_status(failure, now)
                code = f" (exit code {failure.exit_code})" if failure.exit_code is not None else ""
                plan.events.append(Event("Warning", reasons.ENGINE_DEAD, f"slot {slot} ({pod_name}) "
                                         f"{failure.reason}{code}: {_short(failure.message)}"))
                state = "Dead"
            state, total, restarts = restart_policy(spec, plan, slot, pod_name, pod, restarts, total, last_failure,
                                                    now)
    engine = EngineSlotStatus(slot=slot, pod=pod_name, state=cast(SlotState, state), restarts=restarts)
    if pod is not None and state != "Recreating":  # a pod being replaced no longer speaks for the slot
        if pod.pod_ip:
            engine.url = f"http://{pod.pod_ip}:{spec.engine.port}"
        if pod.weight_version:
            engine.weight_version = pod.weight_version
    if last_failure:
        engine.last_failure = last_failure
    return engine, total


def replace_outdated(engines: list[EngineSlotStatus], by_slot: dict[int, PodView], digest: str,
                     plan: FleetPlan) -> int:
    """Delete the pods `engine_update_decide` replaces for an edit of the engine spec (no restart counted:
    the slot is Recreating and its next pod is built from the spec as it is now). Returns how many
    slots still run a pod of an earlier spec."""
    slots = [SlotPod(e.slot, e.state, by_slot[e.slot].engine_spec if e.slot in by_slot else None) for e in engines]
    stale = outdated(slots, digest)
    for slot in slots_to_replace(slots, digest):
        pod, engine = by_slot[slot], engines[slot]
        plan.delete.append((pod.name, pod.uid))
        plan.events.append(Event("Normal", reasons.UPDATING_ENGINE, f"replacing slot {slot} ({pod.name}, "
                                 f"{engine.state}) with a pod of the fleet's changed engine spec "
                                 f"({len(stale)} of {len(engines)} slots on an earlier one)"))
        engine.state = "Recreating"
        engine.url = None
        engine.weight_version = None
        plan.wake_in(2.0)
    return len(stale)


def slot_failure(spec: FleetSpec, pod: PodView | None, state: str, pod_name: str, plan: FleetPlan, *,
                 now: float) -> Failure | None:
    """Why the slot cannot serve now: its pod's failure, its startup timeout, or its pod vanished."""
    if pod is None:
        return Failure(reasons.POD_DELETED, f"pod {pod_name} disappeared") if state in ("Starting", "Ready") else None
    return pod.failure or startup_timeout(spec, pod, plan, now=now)


def startup_timeout(spec: FleetSpec, pod: PodView, plan: FleetPlan, *, now: float) -> Failure | None:
    """A pod not ready `health.startupTimeoutSeconds` after its creation failed to start; before
    then, look again when the timeout ends."""
    if pod.ready or pod.created is None:
        return None
    age = now - pod.created
    limit = spec.health.startup_timeout_seconds
    if age > limit:
        return Failure(reasons.STARTUP_TIMEOUT, f"not ready {int(age)} s after creation "
                       f"(health.startupTimeoutSeconds {limit:g})")
    plan.wake_in(limit - age + 1)
    return None


def failure_status(failure: Failure, now: float) -> FailureStatus:
    last = FailureStatus(reason=failure.reason, message=clip(failure.message, FAILURE_MESSAGE_MAX), time=iso(now))
    if failure.exit_code is not None:
        last.exit_code = failure.exit_code
    return last


def restart_policy(spec: FleetSpec, plan: FleetPlan, slot: int, pod_name: str, pod: PodView | None, restarts: int,
                   total: int, last_failure: FailureStatus | None, now: float) -> tuple[str, int, int]:
    """A dead slot: recreate it when its backoff has passed, or fail it when out of budget.

    The decision is `recovery.decide_dead_slot`, the local backend's too; the run budget left is what
    the fleet has not spent yet (a slot waiting out its backoff spends nothing until recreated).
    Returns the slot's state, the fleet's restarts and the slot's.
    """
    rec = spec.recovery
    decision = decide_dead_slot(restarts=restarts, run_budget_left=rec.max_restarts_per_run - total,
                                dead_since=parse_time(last_failure.time if last_failure else None), now=now,
                                spec=rec)
    if decision.recreate_at is None:
        if decision.give_up is GiveUp.ENGINE_BUDGET:
            why = (f"slot {slot} failed after {restarts} restarts (maxRestartsPerEngine "
                   f"{rec.max_restarts_per_engine}); not recreating it")
        else:
            why = (f"slot {slot} not recreated: the fleet used its {rec.max_restarts_per_run} restarts "
                   "(maxRestartsPerRun)")
        plan.events.append(Event("Warning", reasons.RESTART_BUDGET_EXHAUSTED, why))
        plan.given_up.append(slot)
        return "Failed", total, restarts
    if decision.recreate_at > now:
        plan.wake_in(decision.recreate_at - now)
        return "Dead", total, restarts
    restarts, total = restarts + 1, total + 1
    plan.events.append(Event("Normal", reasons.RECREATING_ENGINE, f"recreating slot {slot} ({pod_name}), restart "
                             f"{restarts} of {rec.max_restarts_per_engine}"))
    plan.recreated.append(slot)
    if pod is not None:
        plan.delete.append((pod.name, pod.uid))
    else:
        plan.create.append((slot, restarts))
    return "Recreating", total, restarts


def fleet_status(spec: FleetSpec, engines: list[EngineSlotStatus], total_restarts: int,
                 previous_conditions: list[dict] | None, *, fleet_name: str, now: float, generation: int | None,
                 existing: int, outdated: int = 0) -> dict:
    """The fleet's status object: counts, slots and the four conditions."""
    ready = sum(1 for e in engines if e.state == "Ready")
    versions = {e.weight_version for e in engines if e.state == "Ready"}
    status = FleetStatus(
        replicas=existing, ready_replicas=ready, selector=b.engine_selector(fleet_name), restarts=total_restarts,
        engines=engines,
        conditions=fleet_conditions(spec, engines, total_restarts, previous_conditions, now=now,
                                    generation=generation, outdated=outdated),
    )
    if len(versions) == 1 and None not in versions:
        status.weight_version = versions.pop()
    if generation is not None:
        status.observed_generation = generation
    return status_dump(status)


def fleet_conditions(spec: FleetSpec, engines: list[EngineSlotStatus], total_restarts: int,
                     previous: list[dict] | None, *, now: float, generation: int | None,
                     outdated: int = 0) -> list[Condition]:
    """Ready (enough engines serve), Progressing (slots starting, or `outdated` pods of an earlier engine
    spec still to replace), Degraded (slots down), Failed (fewer slots than minReadyEngines can ever
    serve again)."""
    replicas = spec.replicas
    ready = sum(1 for e in engines if e.state == "Ready")
    failed = [e for e in engines if e.state == "Failed"]
    down = [e for e in engines if e.state in ("Dead", "Recreating")]
    starting = [e for e in engines if e.state in ("Pending", "Starting", "Recreating")]
    need = max(spec.min_ready_engines, 1) if replicas else 0

    fleet_failed = bool(failed) and replicas - len(failed) < need
    if fleet_failed:
        failed_reason, failed_msg = _fleet_failure(spec, failed[-1], total_restarts)
    else:
        failed_reason, failed_msg = reasons.AS_EXPECTED, f"{len(failed)} of {replicas} slots failed; {need} needed"

    ok = ready >= need
    degraded_slots = failed + down
    return [Condition.model_validate(c) for c in (
        condition("Ready", ok, reasons.ENGINES_READY if ok else reasons.ENGINES_NOT_READY,
                  f"{ready_text(ready, replicas)} engines ready (minReadyEngines {spec.min_ready_engines})",
                  now=now, previous=previous, generation=generation),
        condition("Progressing", bool(starting or outdated) and not fleet_failed,
                  reasons.ENGINES_UPDATING if outdated else reasons.ENGINES_STARTING if starting else reasons.STABLE,
                  "; ".join(filter(None, (
                      f"{outdated} of {replicas} slots on an earlier engine spec, replaced one at a time"
                      if outdated else "",
                      ", ".join(f"slot {e.slot} {e.state}" for e in starting)))) or "all slots settled",
                  now=now, previous=previous, generation=generation),
        condition("Degraded", bool(degraded_slots), reasons.ENGINES_DOWN if degraded_slots else reasons.AS_EXPECTED,
                  "; ".join(f"slot {e.slot} {e.state}: {e.last_failure.reason if e.last_failure else ''}"
                            for e in degraded_slots) or "no slot down",
                  now=now, previous=previous, generation=generation),
        condition("Failed", fleet_failed, failed_reason, failed_msg, now=now, previous=previous, generation=generation),
    )]


def _fleet_failure(spec: FleetSpec, worst: EngineSlotStatus, total_restarts: int) -> tuple[str, str]:
    """The Failed condition's reason and message, from the last slot given up: its last failure, quoted."""
    lf = worst.last_failure
    code = f", exit code {lf.exit_code}" if lf and lf.exit_code is not None else ""
    message = (f"engine slot {worst.slot} failed {worst.restarts + 1} times "
               f"(maxRestartsPerEngine {spec.recovery.max_restarts_per_engine}, "
               f"{total_restarts} of maxRestartsPerRun {spec.recovery.max_restarts_per_run} used); "
               f"last failure {lf.reason if lf else 'Unknown'}{code}:\n{lf.message if lf else ''}")
    crashed = lf is not None and lf.reason in (reasons.CRASHED, reasons.EXITED)
    return (reasons.ENGINE_CRASH_LOOP if crashed else reasons.ENGINE_FAILED), message


def unowned_run_name_events(spec: FleetSpec, owner: str | None, status: dict | None,
                            generation: int | None) -> list[Event]:
    """A fleet that names a run which does not own it serves as a fleet of no run: said once per spec
    generation (a Warning Event), with the run-only fields it sets, which therefore have no effect."""
    if spec.run_name is None or owner is not None or (status or {}).get("observedGeneration") == generation:
        return []
    ignored = run_only_fields_set(spec)
    return [Event("Warning", reasons.RUN_NAME_NOT_OWNED,
                  f"spec.runName {spec.run_name}: TrainingRun {spec.run_name} does not own this fleet (a run's fleets "
                  "are the ones it creates), so it serves as a fleet of no run"
                  + (f"; {', '.join(f'spec.{f}' for f in ignored)} take no effect on it" if ignored else ""))]


def failed_events(conditions: list[dict], previous: list[dict] | None) -> list[Event]:
    """A Warning Event when the fleet's Failed condition turns True (once, not on every reconcile)."""
    events = []
    for cond in conditions:
        old = find(previous, cond["type"])
        if cond["type"] == "Failed" and cond["status"] == "True" and not (old and old["status"] == "True"):
            events.append(Event("Warning", cond["reason"], _short(cond["message"], 1000)))
    return events


@dataclass(frozen=True)
class ChildAction:
    """One write to a fleet's child object: create `obj`, patch its spec to `obj`'s, or delete it."""

    verb: str  # create | patch | delete
    obj: dict


def decide_network_policy(fleet: dict, current: dict | None, *, enabled: bool,
                          metrics_from: Sequence[dict] = (), spec: FleetSpec | None = None,
                          build: Callable[..., dict] = b.build_engine_network_policy) -> ChildAction | None:
    """Converge one of the fleet's NetworkPolicies (`build`: the engines', by default, or the
    router's, `b.build_router_network_policy`): exists and matches when enabled, absent when not.

    `current` is the policy observed now (labelled for this fleet), None when there is none.
    """
    if not enabled:
        return ChildAction("delete", current) if current and not current["metadata"].get("deletionTimestamp") else None
    desired = build(fleet, metrics_from=metrics_from, spec=spec)
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


def decide_router_deployment(fleet: dict, current: dict | None, spec: FleetSpec | None = None, *,
                             follower_image: str = b.DEFAULT_OPERATOR_IMAGE) -> ChildAction | None:
    """Create the fleet's router Deployment, or roll it when its pod template no longer matches the
    fleet's router spec (image, policy, port, health settings) or, for a fleet of no run, its engine
    follower (image, the engines' port). The trainer follows the new pod."""
    desired = b.build_router_deployment(fleet, spec, follower_image=follower_image)
    if current is None:
        return ChildAction("create", desired)
    if current["metadata"].get("deletionTimestamp"):
        return None
    if not covers(current.get("spec", {}).get("template"), desired["spec"]["template"]):
        return ChildAction("patch", desired)
    return None
