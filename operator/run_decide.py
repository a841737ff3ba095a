"""What one reconcile of a TrainingRun must do, from the run and its children. Pure: no I/O.

The run's children are built by `builders`; this decides which are missing, which fleet specs have
drifted from the run's, and the status fields the operator owns. The orchestrator (in the trainer
pod) owns `step`, `weightVersion`, `rewardMean` and `lastEval`; the operator never writes those. The
orchestrator fails a run through the annotations `rlfleet.io/failed-reason` / `failed-message` (e.g.
RolloutEnginesUnavailable); the operator makes them the run's Failed condition.

Phase: Pending -> Running (trainer pod running) -> Succeeded (trainer exited 0) or Failed (trainer
failed or vanished, or the rollout fleet failed: its crash-loop message becomes the run's). A
terminal phase is final: nothing is recreated afterwards. A Succeeded run scales its fleets to zero
so their accelerators are freed; a Failed run keeps its pods for diagnosis.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import ValidationError

from rlfleet.crds.fleet_specs import FleetSpec
from rlfleet.kube.conditions import condition, find, is_true, iso, reason_word
from rlfleet.operator import builders as b
from rlfleet.operator.fleet_decide import Event

TERMINAL = ("Succeeded", "Failed")
OWN_FAILED_REASONS = frozenset({"TrainerFailed", "TrainerLost", "EngineCrashLoop", "EngineFailed", "InvalidSpec",
                                "AsExpected"})
OPERATOR_STATUS_KEYS = ("phase", "message", "readyEngines", "totalEngines", "ready", "engineRestarts", "engines",
                        "conditions", "observedGeneration", "startTime", "completionTime")


@dataclass
class RunChildren:
    rollout: dict | None = None
    eval: dict | None = None
    trainer: dict | None = None
    pvc: dict | None = None


@dataclass
class RunPlan:
    status: dict
    create: list[dict] = field(default_factory=list)
    patch_fleet_specs: list[tuple[str, str, dict]] = field(default_factory=list)  # (kind, name, spec)
    events: list[Event] = field(default_factory=list)


def _pod_terminated(pod: dict) -> dict:
    for s in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (s.get("state") or {}).get("terminated")
        if term:
            return term
    return {}


def _same_spec(desired: dict, current: dict | None) -> bool:
    if current is None:
        return False
    try:
        return FleetSpec.model_validate(desired) == FleetSpec.model_validate(current)
    except ValidationError:
        return False


def decide_run(run: dict, children: RunChildren, *, now: float, rlfleet_image: str | None = None) -> RunPlan:
    meta = run["metadata"]
    old = run.get("status") or {}
    generation = meta.get("generation")
    phase = old.get("phase") or "Pending"
    terminal = phase in TERMINAL
    plan = RunPlan(status={})

    try:
        rollout = b.build_rollout_fleet(run)
        evalf = b.build_eval_fleet(run)
    except (ValidationError, ValueError) as e:
        return _invalid(run, old, str(e), now)

    if not terminal:
        pvc = b.build_snapshot_pvc(run)
        if pvc is not None and children.pvc is None:
            plan.create.append(pvc)
        if children.rollout is None:
            plan.create.append(rollout)
        if evalf is not None and children.eval is None:
            plan.create.append(evalf)
        if children.trainer is None and phase == "Pending":
            plan.create.append(b.build_trainer_pod(run))
    for desired, current in ((rollout, children.rollout), (evalf, children.eval)):
        if desired is None or current is None:
            continue
        if phase == "Succeeded":
            desired = {**desired, "spec": {**desired["spec"], "replicas": 0, "minReadyEngines": 0}}
        if (not terminal or phase == "Succeeded") and not _same_spec(desired["spec"], current.get("spec")):
            plan.patch_fleet_specs.append((desired["kind"], desired["metadata"]["name"], desired["spec"]))

    fleet_status = (children.rollout or {}).get("status") or {}
    fleet_conds = fleet_status.get("conditions") or []
    trainer = children.trainer
    trainer_phase = (trainer.get("status") or {}).get("phase") if trainer else None
    old_failed = find(old.get("conditions"), "Failed")
    failed_reason = failed_message = None
    annotations = meta.get("annotations") or {}
    if annotations.get(b.ANN_FAILED_REASON):  # the orchestrator failed the run
        failed_reason = reason_word(annotations[b.ANN_FAILED_REASON])
        failed_message = annotations.get(b.ANN_FAILED_MESSAGE, "")
    elif old_failed and old_failed.get("status") == "True" and old_failed.get("reason") not in OWN_FAILED_REASONS:
        failed_reason, failed_message = old_failed["reason"], old_failed.get("message", "")
    message = old.get("message") or ""
    new_phase = phase
    if not terminal:
        if failed_reason:
            new_phase = "Failed"
        elif trainer_phase == "Succeeded":
            new_phase, message = "Succeeded", "the trainer finished"
        elif trainer_phase == "Failed":
            assert trainer is not None, "the phase is the trainer pod's"
            term = _pod_terminated(trainer)
            failed_reason = "TrainerFailed"
            code = f" with exit code {term['exitCode']}" if term.get("exitCode") is not None else ""
            failed_message = f"trainer pod {trainer['metadata']['name']} failed{code}:\n{term.get('message', '')}"
            new_phase = "Failed"
        elif is_true(fleet_conds, "Failed"):
            fc = find(fleet_conds, "Failed")
            assert fc is not None, "is_true found it"
            failed_reason, failed_message = fc.get("reason", "EngineFailed"), fc.get("message", "")
            new_phase = "Failed"
        elif trainer is None and phase == "Running":
            failed_reason, failed_message = "TrainerLost", f"trainer pod {b.trainer_pod_name(meta['name'])} disappeared"
            new_phase = "Failed"
        elif trainer_phase == "Running":
            new_phase, message = "Running", "training"
        else:
            message = "waiting for the trainer pod" if trainer else "creating the run's objects"
        if new_phase == "Failed":
            message = failed_message or message
    elif phase == "Failed" and old_failed:
        failed_reason, failed_message = old_failed.get("reason"), old_failed.get("message", "")

    replicas = int(run["spec"].get("rollout", {}).get("replicas", 1))
    ready = int(fleet_status.get("readyReplicas") or 0)
    status: dict = {
        "phase": new_phase,
        "message": message,
        "readyEngines": ready,
        "totalEngines": replicas,
        "ready": f"{ready}/{replicas}",
        "engineRestarts": int(fleet_status.get("restarts") or 0),
        "engines": fleet_status.get("engines") or [],
    }
    if generation is not None:
        status["observedGeneration"] = generation
    start = old.get("startTime")
    if not start and new_phase in ("Running", *TERMINAL):
        start = (trainer or {}).get("status", {}).get("startTime") or iso(now)
    if start:
        status["startTime"] = start
    if new_phase in TERMINAL:
        status["completionTime"] = old.get("completionTime") or iso(now)
    prev = old.get("conditions")
    fleet_ready = is_true(fleet_conds, "Ready")
    status["conditions"] = [
        condition("Ready", new_phase == "Running" and fleet_ready,
                  "Training" if new_phase == "Running" and fleet_ready else ("Finished" if new_phase in TERMINAL
                                                                             else "NotReady"),
                  f"phase {new_phase}; {ready}/{replicas} rollout engines ready", now=now, previous=prev,
                  generation=generation),
        condition("Progressing", new_phase in ("Pending", "Running"), "Training" if new_phase == "Running"
                  else ("Starting" if new_phase == "Pending" else "Finished"), message, now=now, previous=prev,
                  generation=generation),
        condition("Degraded", is_true(fleet_conds, "Degraded") and new_phase not in TERMINAL,
                  (find(fleet_conds, "Degraded") or {}).get("reason", "AsExpected") if new_phase not in TERMINAL
                  else "AsExpected", (find(fleet_conds, "Degraded") or {}).get("message", ""), now=now, previous=prev,
                  generation=generation),
        condition("Failed", new_phase == "Failed", failed_reason or "AsExpected", failed_message or "",
                  now=now, previous=prev, generation=generation),
    ]
    plan.status = status
    if new_phase != phase:
        kind = "Warning" if new_phase == "Failed" else "Normal"
        reason = failed_reason if new_phase == "Failed" else new_phase
        plan.events.append(Event(kind, reason or new_phase, message[-1000:] or new_phase))
    return plan


def _invalid(run: dict, old: dict, error: str, now: float) -> RunPlan:
    """A spec the builders reject (the API server's schema let it through): fail clearly, create nothing."""
    generation = run["metadata"].get("generation")
    status = {"phase": old.get("phase") if old.get("phase") in TERMINAL else "Failed", "message": error,
              "conditions": [condition("Failed", True, "InvalidSpec", error, now=now, previous=old.get("conditions"),
                                       generation=generation)]}
    if generation is not None:
        status["observedGeneration"] = generation
    events = [] if old.get("phase") == "Failed" else [Event("Warning", "InvalidSpec", error[-1000:])]
    return RunPlan(status=status, events=events)


def owned_status(status: dict | None) -> dict:
    """The part of a run's status the operator writes (to compare before writing)."""
    return {k: v for k, v in (status or {}).items() if k in OPERATOR_STATUS_KEYS}
