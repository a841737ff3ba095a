"""What one reconcile of a TrainingRun must do, from the run and its children. Pure: no I/O.

The run's children are built by `builders`; this decides which are missing, which fleet specs have
drifted from the run's, and the status fields the operator owns. The orchestrator (in the trainer
pod) owns `step`, `weightVersion`, `rewardMean`, `lastEval` and `orchestratorFailure`; the operator
never writes those. The orchestrator fails a run through `status.orchestratorFailure` (e.g.
RolloutEnginesUnavailable); the operator makes it the run's Failed condition.

A run that splits the model (tensor or pipeline parallel) gets its fleets only after its trainer pod
checked the layout against the model (`status.trainer.layoutChecked`): only the trainer reads the model,
and a layout it cannot take then fails the run before any engine starts (`awaiting_layout_check`).

Phase: Pending -> Running (trainer pod running) -> Succeeded (trainer exited 0) or Failed (the
orchestrator reported a failure, the rollout fleet failed: its crash-loop message becomes the run's,
or the trainer pod failed or vanished more often than spec.trainer.maxRestarts allows: before that it
is recreated after a backoff, see `trainer_decide`). A terminal phase is final: nothing is recreated
afterwards. A Succeeded run scales its fleets to zero
so their accelerators are freed; a Failed run keeps its pods for diagnosis.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ValidationError

from rlfleet.crds import reasons
from rlfleet.crds.fleet_specs import FleetSpec
from rlfleet.crds.loader import cluster_run_errors, derivation_errors
from rlfleet.crds.models import TrainingRunSpec
from rlfleet.crds.status import Condition, RunPhase, TrainerStatus, TrainingRunStatus, ready_text, status_dump
from rlfleet.kube.conditions import condition, find, is_true, iso, reason_word
from rlfleet.kube.marks import RUN_FAILURE
from rlfleet.kube.refusals import Rejection
from rlfleet.operator import builders as b
from rlfleet.operator.fleet_decide import Event
from rlfleet.operator.trainer_decide import TrainerPlan, decide_trainer
from rlfleet.util.redact import redact

TERMINAL = ("Succeeded", "Failed")
RESTORED_FIELDS_SHOWN = 5  # fields an Event names when a run's fleet is set back to the run's spec
# Failed reasons the operator sets itself; any other True Failed condition was adopted from the
# orchestrator, and is kept once its report is gone.
OWN_FAILED_REASONS = frozenset({reasons.TRAINER_FAILED, reasons.TRAINER_LOST, reasons.ENGINE_CRASH_LOOP,
                                reasons.ENGINE_FAILED, reasons.INVALID_SPEC, reasons.AS_EXPECTED,
                                reasons.CHILD_REJECTED})
OPERATOR_STATUS_KEYS = ("phase", "message", "readyEngines", "totalEngines", "ready", "engineRestarts",
                        "rolloutReplicas", "rolloutSelector", "engines", "conditions", "observedGeneration",
                        "startTime", "completionTime", "trainer")


@dataclass
class RunChildren:
    rollout: dict | None = None
    eval: dict | None = None
    trainer: dict | None = None  # the trainer pod; of a trainer group, pod 0 (rank 0 runs the run)
    pvc: dict | None = None
    # The run's update-group NetworkPolicies (`update_group_decide`; decide_run does not read them).
    update_group_policies: list[dict] = field(default_factory=list)
    trainer_group: list[dict] = field(default_factory=list)  # every trainer pod of a group, pod 0 included

    def trainer_pods(self) -> list[dict]:
        return self.trainer_group or ([self.trainer] if self.trainer is not None else [])


@dataclass
class RunPlan:
    status: dict
    create: list[dict] = field(default_factory=list)
    patch_fleet_specs: list[tuple[str, str, dict]] = field(default_factory=list)  # (kind, name, spec)
    events: list[Event] = field(default_factory=list)
    delete: list[tuple[str, str]] = field(default_factory=list)  # (name, uid) of pods: a failed trainer group's
    # The run's fleets whose API-key Secrets must exist before this pass creates a fleet or a trainer pod
    # (the trainer's env reads the rollout fleet's key, and may be created before the fleets).
    api_key_fleets: list[str] = field(default_factory=list)
    requeue_after: float | None = None  # reconcile again then (a trainer's backoff ends)
    # resourceVersions the pass's own status writes replaced (operator/staleness.py)
    superseded_versions: frozenset[str] = frozenset()


@dataclass(frozen=True)
class PhaseChange:
    """Where a reconcile takes the run: its phase and message, and why it failed (if it did)."""

    phase: RunPhase
    message: str
    failed_reason: str | None = None
    failed_message: str | None = None


def _pod_terminated(pod: dict) -> dict:
    for s in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (s.get("state") or {}).get("terminated")
        if term:
            return {**term, "message": redact(term.get("message") or "")}
    return {}


def _same_spec(desired: dict, current: dict | None) -> bool:
    if current is None:
        return False
    try:
        return FleetSpec.model_validate(desired) == FleetSpec.model_validate(current)
    except ValidationError:
        return False


def decide_run(run: dict, children: RunChildren, *, now: float, rlfleet_image: str | None = None,
               rejected: Sequence[Rejection] = ()) -> RunPlan:
    """One level-based reconcile of a TrainingRun: children to create, fleet specs to patch, status, Events.

    The run's spec is validated once, here; the policies below take it typed. `rejected`: children
    the API server refused for good in this pass; a run not yet terminal fails with reason ChildRejected
    and the server's message.
    """
    meta = run["metadata"]
    old = run.get("status") or {}
    phase: RunPhase = old.get("phase") or "Pending"
    try:
        spec = b.run_spec(run)
        # Refused, not ignored or half-built: checked while the run is admitted (a run that an earlier
        # operator let start is not failed midway, nor one that ended given a failure after the fact).
        if phase == "Pending" and (refused := derivation_errors(spec) + cluster_run_errors(spec)):
            return _invalid(run, old, "; ".join(map(str, refused)), now)
        rollout = b.build_rollout_fleet(run, spec)
        evalf = b.build_eval_fleet(run, spec)
    except (ValidationError, ValueError) as e:
        return _invalid(run, old, str(e), now)

    fleet_status = (children.rollout or {}).get("status") or {}
    old_failed = find(old.get("conditions"), "Failed")
    adopted = adopted_failure(old.get(RUN_FAILURE), old_failed)
    fleet_conditions = fleet_status.get("conditions") or []
    # The trainer pod is recreated only for a failure the run did not report itself, beside a fleet that
    # has not failed; otherwise the run fails as before.
    trainer_plan = None
    if phase not in TERMINAL and not adopted[0] and not is_true(fleet_conditions, "Failed") and not rejected:
        trainer_plan = decide_trainer(pods=children.trainer_pods(), nodes=spec.trainer.nodes, phase=phase,
                                      old=old.get("trainer"), max_restarts=spec.trainer.max_restarts,
                                      pod_names=b.trainer_pod_names(meta["name"], spec.trainer.nodes), now=now)
    change = next_phase(phase, adopted=adopted, old_failed=old_failed, old_message=old.get("message") or "",
                        trainer=children.trainer, fleet_conditions=fleet_conditions, run_name=meta["name"],
                        trainer_plan=trainer_plan)
    if rejected and phase not in TERMINAL:
        text = "\n".join(r.text() for r in rejected)
        change = PhaseChange("Failed", text, reasons.CHILD_REJECTED, text)
    layout_pending = awaiting_layout_check(spec, old, children)
    if layout_pending and change.phase not in TERMINAL:
        change = PhaseChange(change.phase, LAYOUT_CHECK_MESSAGE.format(tp=spec.trainer.tensor_parallel_size,
                                                                       pp=spec.trainer.pipeline_parallel_size))
    plan = RunPlan(
        status=run_status(spec, old, change, fleet_status, trainer=children.trainer, now=now,
                          generation=meta.get("generation"), trainer_plan=trainer_plan),
        create=missing_children(run, spec, children, phase, rollout=rollout, eval_fleet=evalf,
                                trainer_plan=trainer_plan, fleets=not layout_pending,
                                rlfleet_image=rlfleet_image or b.DEFAULT_RLFLEET_IMAGE),
        patch_fleet_specs=drifted_fleet_specs(phase, [(rollout, children.rollout), (evalf, children.eval)]),
        events=phase_events(phase, change),
    )
    plan.events.extend(fleet_scale_events(phase, plan.patch_fleet_specs, [children.rollout, children.eval]))
    plan.events.extend(fleet_restore_events(plan.patch_fleet_specs, [children.rollout, children.eval]))
    if any(obj["kind"] in ("RolloutFleet", "EvalFleet", "Pod") for obj in plan.create):
        plan.api_key_fleets = [f["metadata"]["name"] for f in (rollout, evalf) if f is not None]
    if trainer_plan is not None and change.phase not in TERMINAL:
        plan.events[:0] = trainer_plan.events
        plan.delete = list(trainer_plan.delete)
        plan.requeue_after = trainer_plan.requeue_after
    return plan


LAYOUT_CHECK_MESSAGE = ("waiting for the trainer pod to check tensorParallelSize {tp} x pipelineParallelSize {pp} "
                        "against the model before the fleets are created")


def awaiting_layout_check(spec: TrainingRunSpec, old_status: dict, children: RunChildren) -> bool:
    """Whether the run's fleets wait for its trainer pod's layout check: a run that splits the model
    (tensor or pipeline parallel) gets them once `status.trainer.layoutChecked` says the model fits, so a
    layout the model cannot take fails the run before any engine starts. Fleets that exist already (an
    earlier check, or an operator before this rule) stay as they are."""
    if not spec.trainer.splits_model or children.rollout is not None or children.eval is not None:
        return False
    return (old_status.get("trainer") or {}).get("layoutChecked") is not True


def missing_children(run: dict, spec: TrainingRunSpec, children: RunChildren, phase: str, *, rollout: dict,
                     eval_fleet: dict | None, trainer_plan: TrainerPlan | None = None,
                     fleets: bool = True, rlfleet_image: str = b.DEFAULT_RLFLEET_IMAGE) -> list[dict]:
    """The children to create: claim, fleets (unless `fleets` is False: they wait for the trainer's
    layout check) and the trainer pod `trainer_plan` asks for (the first one while Pending, a recreated
    one after a failure; the operator's `rlfleet_image` unless the spec names one); none once terminal."""
    if phase in TERMINAL:
        return []
    create = []
    pvc = b.build_snapshot_pvc(run, spec)
    if pvc is not None and children.pvc is None:
        create.append(pvc)
    if fleets and children.rollout is None:
        create.append(rollout)
    if fleets and eval_fleet is not None and children.eval is None:
        create.append(eval_fleet)
    if trainer_plan is not None and trainer_plan.create is not None and trainer_plan.give_up is None:
        create.extend(b.build_trainer_pods(run, spec, restarts=trainer_plan.create, nodes=trainer_plan.create_nodes,
                                           rlfleet_image=rlfleet_image))
    return create


def drifted_fleet_specs(phase: str, fleets: list[tuple[dict | None, dict | None]]) -> list[tuple[str, str, dict]]:
    """(kind, name, spec) of each fleet whose spec differs from the one the run implies (desired,
    current). A Succeeded run scales its fleets to zero; a Failed one leaves them as they are."""
    patches = []
    for desired, current in fleets:
        if desired is None or current is None:
            continue
        if phase == "Succeeded":
            desired = {**desired, "spec": {**desired["spec"], "replicas": 0, "minReadyEngines": 0}}
        if (phase not in TERMINAL or phase == "Succeeded") and not _same_spec(desired["spec"], current.get("spec")):
            patches.append((desired["kind"], desired["metadata"]["name"], desired["spec"]))
    return patches


def fleet_scale_events(phase: str, patches: list[tuple[str, str, dict]], fleets: list[dict | None]) -> list[Event]:
    """A Normal Event on the run for each fleet whose replicas its spec patch changes: the run's
    spec.rollout.replicas changed, a scale of the fleet itself is undone, or a Succeeded run stops it."""
    current = {(f["kind"], f["metadata"]["name"]): f.get("spec") or {} for f in fleets if f is not None}
    field = {"RolloutFleet": "spec.rollout.replicas", "EvalFleet": "spec.eval.fleet.replicas"}
    events = []
    for kind, name, spec in patches:
        before, after = current.get((kind, name), {}).get("replicas"), spec.get("replicas")
        if before != after:
            why = "the run succeeded" if phase == "Succeeded" else f"the run's {field.get(kind, 'spec')} is {after}"
            events.append(Event("Normal", reasons.SCALING_FLEET, f"scaling {kind} {name} from {before} to {after} "
                                f"engine(s): {why}"))
    return events


def differing_fields(desired: BaseModel, current: BaseModel, prefix: str = "spec") -> list[str]:
    """The camelCase paths (`spec.engine.maxTotalTokens`) of the leaf fields where two models differ."""
    paths = []
    for name, info in type(desired).model_fields.items():
        a, c = getattr(desired, name), getattr(current, name)
        path = f"{prefix}.{info.alias or name}"
        if isinstance(a, BaseModel) and type(a) is type(c):
            paths += differing_fields(a, c, path)
        elif a != c:
            paths.append(path)
    return paths


def fleet_restore_events(patches: list[tuple[str, str, dict]], fleets: list[dict | None]) -> list[Event]:
    """A Warning Event on the run for each fleet whose spec was edited apart from its run (anything but its
    replicas and minimum, which `fleet_scale_events` tells): the operator sets it back, and says which
    fields and where to make such a change instead."""
    current = {(f["kind"], f["metadata"]["name"]): f.get("spec") for f in fleets if f is not None}
    events = []
    for kind, name, spec in patches:
        try:
            edited = differing_fields(FleetSpec.model_validate(spec), FleetSpec.model_validate(current[(kind, name)]))
        except (KeyError, ValidationError):
            continue
        edited = [p for p in edited if p not in ("spec.replicas", "spec.minReadyEngines")]
        if edited:
            shown = ", ".join(edited[:RESTORED_FIELDS_SHOWN]) + (
                f" and {len(edited) - RESTORED_FIELDS_SHOWN} more" if len(edited) > RESTORED_FIELDS_SHOWN else "")
            events.append(Event("Warning", reasons.RESTORING_FLEET_SPEC,
                                f"setting {kind} {name} back to the spec of its run: {shown} differed (a run's "
                                "fleets follow the TrainingRun; change the run instead)"))
    return events


def adopted_failure(reported: dict | None, old_failed: dict | None) -> tuple[str | None, str | None]:
    """(reason, message) of a failure the run adopts: the orchestrator's `status.orchestratorFailure`,
    or a Failed condition adopted from it before (not one the operator set itself)."""
    if isinstance(reported, dict) and reported.get("reason"):
        return reason_word(str(reported["reason"])), str(reported.get("message") or "")
    if old_failed and old_failed.get("status") == "True" and old_failed.get("reason") not in OWN_FAILED_REASONS:
        return old_failed["reason"], old_failed.get("message", "")
    return None, None


def next_phase(phase: RunPhase, *, adopted: tuple[str | None, str | None], old_failed: dict | None, old_message: str,
               trainer: dict | None, fleet_conditions: list[dict], run_name: str,
               trainer_plan: TrainerPlan | None = None) -> PhaseChange:
    """Phase transitions: Pending -> Running -> Succeeded or Failed; a terminal phase is final.

    `trainer_plan`: the trainer pod's restart decision; a pending recreation keeps the phase, a
    budget spent fails the run with the trainer's failure."""
    failed_reason, failed_message = adopted
    if phase in TERMINAL:
        if phase == "Failed" and old_failed:
            failed_reason, failed_message = old_failed.get("reason"), old_failed.get("message", "")
        return PhaseChange(phase, old_message, failed_reason, failed_message)
    trainer_phase = (trainer.get("status") or {}).get("phase") if trainer else None
    if failed_reason:
        pass
    elif trainer_phase == "Succeeded":
        return PhaseChange("Succeeded", "the trainer finished")
    elif trainer_plan is not None and trainer_plan.give_up is not None:
        failed_reason, failed_message = trainer_plan.give_up.reason, trainer_plan.give_up.message
    elif trainer_plan is not None and trainer_plan.restarting:
        return PhaseChange(phase, trainer_plan.restarting)
    elif trainer is not None and trainer_phase == "Failed":
        term = _pod_terminated(trainer)
        code = f" with exit code {term['exitCode']}" if term.get("exitCode") is not None else ""
        failed_reason = reasons.TRAINER_FAILED
        failed_message = f"trainer pod {trainer['metadata']['name']} failed{code}:\n{term.get('message', '')}"
    elif is_true(fleet_conditions, "Failed"):  # the rollout fleet's crash-loop message becomes the run's
        fc = find(fleet_conditions, "Failed") or {}
        failed_reason, failed_message = fc.get("reason", reasons.ENGINE_FAILED), fc.get("message", "")
    elif trainer is None and phase == "Running":
        failed_reason = reasons.TRAINER_LOST
        failed_message = f"trainer pod {b.trainer_pod_name(run_name)} disappeared"
    elif trainer_phase == "Running":
        return PhaseChange("Running", "training")
    else:
        return PhaseChange(phase, "waiting for the trainer pod" if trainer else "creating the run's objects")
    return PhaseChange("Failed", failed_message or old_message, failed_reason, failed_message)


def run_status(spec: TrainingRunSpec, old: dict, change: PhaseChange, fleet_status: dict, *, trainer: dict | None,
               now: float, generation: int | None, trainer_plan: TrainerPlan | None = None) -> dict:
    """The status fields the operator owns: phase, counts from the rollout fleet, times, conditions,
    the trainer pod's recreations (kept as they were once the run is terminal)."""
    replicas = spec.rollout.replicas
    ready = int(fleet_status.get("readyReplicas") or 0)
    status = TrainingRunStatus(
        phase=change.phase, message=change.message, ready_engines=ready, total_engines=replicas,
        engine_restarts=int(fleet_status.get("restarts") or 0), engines=fleet_status.get("engines") or [],
        rollout_replicas=int(fleet_status.get("replicas") or 0), rollout_selector=fleet_status.get("selector"),
        conditions=run_conditions(change, fleet_status.get("conditions") or [], old.get("conditions"),
                                  ready=ready, replicas=replicas, now=now, generation=generation),
    )
    if generation is not None:
        status.observed_generation = generation
    if trainer_plan is not None:
        status.trainer = trainer_plan.status
    elif old.get("trainer"):
        status.trainer = TrainerStatus.model_validate(old["trainer"])
    start = old.get("startTime")
    if not start and change.phase in ("Running", *TERMINAL):
        start = (trainer or {}).get("status", {}).get("startTime") or iso(now)
    if start:
        status.start_time = start
    if change.phase in TERMINAL:
        status.completion_time = old.get("completionTime") or iso(now)
    return status_dump(status)


def run_conditions(change: PhaseChange, fleet_conds: list[dict], previous: list[dict] | None, *, ready: int,
                   replicas: int, now: float, generation: int | None) -> list[Condition]:
    """Ready (training on a ready fleet), Progressing, Degraded (the fleet's, while not terminal), Failed."""
    phase = change.phase
    terminal = phase in TERMINAL
    fleet_ready = is_true(fleet_conds, "Ready")
    degraded = find(fleet_conds, "Degraded") or {}
    training = phase == "Running" and fleet_ready
    return [Condition.model_validate(c) for c in (
        condition("Ready", training,
                  reasons.TRAINING if training else (reasons.FINISHED if terminal else reasons.NOT_READY),
                  f"phase {phase}; {ready_text(ready, replicas)} rollout engines ready", now=now, previous=previous,
                  generation=generation),
        condition("Progressing", phase in ("Pending", "Running"),
                  reasons.TRAINING if phase == "Running" else (reasons.STARTING if phase == "Pending"
                                                               else reasons.FINISHED),
                  change.message, now=now, previous=previous, generation=generation),
        condition("Degraded", is_true(fleet_conds, "Degraded") and not terminal,
                  degraded.get("reason", reasons.AS_EXPECTED) if not terminal else reasons.AS_EXPECTED,
                  degraded.get("message", ""), now=now, previous=previous, generation=generation),
        condition("Failed", phase == "Failed", change.failed_reason or reasons.AS_EXPECTED,
                  change.failed_message or "", now=now, previous=previous, generation=generation),
    )]


def phase_events(phase: str, change: PhaseChange) -> list[Event]:
    """One Event per phase change: Warning with the failure's reason, else Normal named after the phase."""
    if change.phase == phase:
        return []
    failed = change.phase == "Failed"
    reason = change.failed_reason if failed else change.phase
    return [Event("Warning" if failed else "Normal", reason or change.phase, change.message[-1000:] or change.phase)]


def _invalid(run: dict, old: dict, error: str, now: float) -> RunPlan:
    """A spec the builders reject (the API server's schema let it through): fail clearly, create nothing."""
    generation = run["metadata"].get("generation")
    status = TrainingRunStatus(
        phase=old.get("phase") if old.get("phase") in TERMINAL else "Failed", message=error,
        conditions=[Condition.model_validate(condition("Failed", True, reasons.INVALID_SPEC, error, now=now,
                                                       previous=old.get("conditions"), generation=generation))])
    if generation is not None:
        status.observed_generation = generation
    events = [] if old.get("phase") in TERMINAL else [Event("Warning", reasons.INVALID_SPEC, error[-1000:])]
    return RunPlan(status=status_dump(status), events=events)


def owned_status(status: dict | None) -> dict:
    """The part of a run's status the operator writes (to compare before writing)."""
    return {k: v for k, v in (status or {}).items() if k in OPERATOR_STATUS_KEYS}
