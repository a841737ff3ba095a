"""Whether to recreate a run's trainer pod, and when. Pure: no I/O.

A trainer pod that failed, or vanished while the run was Running, is recreated within
`spec.trainer.maxRestarts` after an exponential backoff (`rlfleet.policy.recovery.exponential_backoff`,
the one backoff rule). Not here: failures the run reported itself (`status.orchestratorFailure`: a
fleet's crash loop, a watchdog trip, an invalid spec) and a Failed rollout fleet; `run_decide` fails
the run on those first and never asks.

The state lives in the cluster, so an operator restart counts nothing twice: `status.trainer`
(`restarts`, `failures`, `lastFailure` with its time) and the trainer pod's `rlfleet.io/restarts`
annotation (the incarnation: 0 for the first pod, n for the n-th recreation). A failure is recorded
once (`failures` = `restarts` + 1 while the recreation is pending); the pending recreation deletes the
failed pod when its backoff has passed, creates the next incarnation once the name is free, and is
done when that pod is seen (`restarts` := its annotation).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rlfleet.crds import reasons
from rlfleet.crds.status import FailureStatus, TrainerStatus
from rlfleet.kube.conditions import iso, parse_time
from rlfleet.kube.pods import FAILURE_MESSAGE_MAX, view_pod
from rlfleet.operator.fleet_decide import Event
from rlfleet.policy.recovery import exponential_backoff
from rlfleet.util.redact import redact

BACKOFF_BASE_S = 10.0
BACKOFF_MAX_S = 300.0


@dataclass(frozen=True)
class TrainerFailure:
    reason: str  # TrainerFailed (the pod failed) or TrainerLost (it vanished)
    message: str
    exit_code: int | None = None


@dataclass
class TrainerPlan:
    """What to do with the trainer pod in this reconcile."""

    status: TrainerStatus
    create: int | None = None  # create the trainer pod, this incarnation (its restarts annotation)
    delete: tuple[str, str] | None = None  # (name, uid) of the failed pod, deleted to free its name
    give_up: TrainerFailure | None = None  # out of budget: the run fails with this
    restarting: str | None = None  # a recreation is pending: the run's message meanwhile
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None


def backoff_s(restarts: int) -> float:
    """Seconds between a trainer failure and its recreation, after `restarts` recreations so far."""
    return exponential_backoff(restarts, BACKOFF_BASE_S, BACKOFF_MAX_S)


def trainer_failure(pod: dict | None, *, phase: str, pod_name: str) -> TrainerFailure | None:
    """Why the trainer no longer trains: its pod failed (exit code, last log lines), or it vanished
    while the run was Running; None while it runs, starts or has not been created yet."""
    if pod is None:
        return TrainerFailure(reasons.TRAINER_LOST, f"trainer pod {pod_name} disappeared") if phase == "Running" \
            else None
    if (pod.get("status") or {}).get("phase") != "Failed":
        return None
    term: dict = next((s["state"]["terminated"] for s in (pod.get("status") or {}).get("containerStatuses") or []
                 if (s.get("state") or {}).get("terminated")), {})
    code = term.get("exitCode")
    text = f" with exit code {code}" if code is not None else ""
    log_lines = redact(term.get("message") or (pod.get("status") or {}).get("message") or "")
    return TrainerFailure(reasons.TRAINER_FAILED, f"trainer pod {pod['metadata']['name']} failed{text}:\n{log_lines}",
                          code)


def decide_trainer(*, pod: dict | None, phase: str, old: dict | None, max_restarts: int, pod_name: str,
                   now: float) -> TrainerPlan:
    """One reconcile of the trainer pod of a run that is neither terminal nor failed for another reason.

    `old`: the run's `status.trainer` as read. Creates the first pod while Pending, records a new
    failure once, recreates after the backoff within `max_restarts`, or gives up.
    """
    prev = TrainerStatus.model_validate(old or {})
    view = view_pod(pod) if pod is not None else None
    incarnation = view.restarts if view is not None else 0
    restarts = max(prev.restarts, incarnation)
    failures = max(prev.failures, restarts)
    # ranks/ready are the trainer pod's own report: carried as read, never rewritten here.
    status = TrainerStatus(restarts=restarts, failures=failures, ranks=prev.ranks, ready=prev.ready)
    if prev.last_failure is not None:
        status.last_failure = prev.last_failure
    plan = TrainerPlan(status=status)
    pending = failures > restarts

    if not pending:
        failure = trainer_failure(pod, phase=phase, pod_name=pod_name)
        if failure is None:
            if pod is None:  # the first pod (Pending), or one deleted before it ever ran: created again
                plan.create = restarts
            return plan
        if restarts >= max_restarts:
            budget = (f"recreated {restarts} time(s), spec.trainer.maxRestarts {max_restarts}" if max_restarts
                      else "spec.trainer.maxRestarts is 0")
            plan.give_up = TrainerFailure(failure.reason, f"{failure.message.rstrip()}\n({budget})"
                                          if max_restarts else failure.message, failure.exit_code)
            status.failures = restarts + 1
            return plan
        status.failures = failures = restarts + 1
        status.last_failure = FailureStatus(reason=failure.reason, message=failure.message[-FAILURE_MESSAGE_MAX:],
                                            time=iso(now))
        if failure.exit_code is not None:
            status.last_failure.exit_code = failure.exit_code
        plan.events.append(Event("Warning", reasons.TRAINER_DEAD,
                                 f"{failure.message[-800:]}\nrecreating it in {backoff_s(restarts):g} s "
                                 f"(restart {restarts + 1} of {max_restarts})"))

    # A recreation is pending: wait out the backoff, free the pod's name, create the next incarnation.
    failed_at = parse_time(status.last_failure.time if status.last_failure else None)
    due = (failed_at if failed_at is not None else now) + backoff_s(restarts)
    what = status.last_failure.reason if status.last_failure else reasons.TRAINER_FAILED
    if now < due:
        plan.restarting = f"{what}: recreating the trainer pod in {due - now:.0f} s (restart {restarts + 1} of " \
                          f"{max_restarts})"
        plan.requeue_after = due - now
    elif view is not None:
        if not view.terminating:
            plan.delete = (view.name, view.uid)
        plan.restarting = f"{what}: deleting the failed trainer pod {view.name} before recreating it"
        plan.requeue_after = 2.0
    else:
        plan.create = restarts + 1
        plan.restarting = f"{what}: recreating the trainer pod (restart {restarts + 1} of {max_restarts})"
        plan.events.append(Event("Normal", reasons.RECREATING_TRAINER,
                                 f"creating {pod_name} again (restart {restarts + 1} of {max_restarts}); it resumes "
                                 "from the newest complete checkpoint"))
        plan.requeue_after = 2.0
    return plan
