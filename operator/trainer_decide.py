"""Whether to recreate a run's trainer pod (or its group of pods), and when. Pure: no I/O.

A trainer of several nodes is a group of pods `<run>-trainer-<i>` that fails and restarts as one
(gang semantics): any pod of the group failing or vanishing while the run is Running is one failure of
the trainer; the recreation deletes every pod of the group, then creates the whole group again, and
counts one restart. Everything below says "the trainer pod"; for a group read "the group's pods".

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
from rlfleet.operator.builders import trainer_pod_node
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
    """What to do with the trainer pods in this reconcile."""

    status: TrainerStatus
    create: int | None = None  # create trainer pods, this incarnation (their restarts annotation) ...
    create_nodes: list[int] = field(default_factory=list)  # ... for these node ranks
    delete: list[tuple[str, str]] = field(default_factory=list)  # (name, uid) of the failed group's pods
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
    term = _terminated(pod)
    code = term.get("exitCode")
    text = f" with exit code {code}" if code is not None else ""
    log_lines = redact(term.get("message") or (pod.get("status") or {}).get("message") or "")
    return TrainerFailure(reasons.TRAINER_FAILED, f"trainer pod {pod['metadata']['name']} failed{text}:\n{log_lines}",
                          code)


def _terminated(pod: dict) -> dict:
    return next((s["state"]["terminated"] for s in (pod.get("status") or {}).get("containerStatuses") or []
                 if (s.get("state") or {}).get("terminated")), {})


def pods_by_node(pods: list[dict], nodes: int) -> dict[int, dict]:
    """The trainer's pods by node rank (0 .. nodes-1); pods of other ranks are not the group's."""
    by_node: dict[int, dict] = {}
    for pod in pods:
        node = trainer_pod_node(pod)
        if 0 <= node < nodes:
            by_node[node] = pod
    return by_node


def group_failure(by_node: dict[int, dict], *, nodes: int, phase: str, pod_names: list[str]) -> TrainerFailure | None:
    """The group's failure: the first of its pods to fail (pod 0 last among equals: its rank 0 fails
    because a peer did), else one missing while the run is Running; None while all run or start."""
    failed = [(node, pod) for node, pod in by_node.items() if (pod.get("status") or {}).get("phase") == "Failed"]
    if failed:
        node, pod = min(failed, key=lambda np: (str(_terminated(np[1]).get("finishedAt") or ""), np[0] == 0, np[0]))
        failure = trainer_failure(pod, phase=phase, pod_name=pod_names[node])
        assert failure is not None
        if nodes == 1:
            return failure
        return TrainerFailure(failure.reason, f"{failure.message.rstrip()}\n(the trainer group of {nodes} pods fails "
                                              "as one)", failure.exit_code)
    missing = [pod_names[n] for n in range(nodes) if n not in by_node]
    if missing and phase == "Running":
        if nodes == 1:
            return trainer_failure(None, phase=phase, pod_name=missing[0])
        return TrainerFailure(reasons.TRAINER_LOST, f"trainer pod(s) {', '.join(missing)} of the group of {nodes} "
                                                    "disappeared (the group fails as one)")
    return None


def complete_incarnation(by_node: dict[int, dict], nodes: int) -> int | None:
    """The incarnation of the group when every node has its pod and all are of one incarnation."""
    if len(by_node) != nodes:
        return None
    incarnations = {view_pod(pod).restarts for pod in by_node.values()}
    return incarnations.pop() if len(incarnations) == 1 else None


def decide_trainer(*, pods: list[dict], nodes: int, phase: str, old: dict | None, max_restarts: int,
                   pod_names: list[str], now: float) -> TrainerPlan:
    """One reconcile of the trainer pods of a run that is neither terminal nor failed for another reason.

    `pods`: the trainer pods the run owns; `pod_names`: their names by node rank; `old`: the run's
    `status.trainer` as read. Creates the first pods while Pending, records a new failure once,
    recreates the whole group after the backoff within `max_restarts`, or gives up.
    """
    prev = TrainerStatus.model_validate(old or {})
    by_node = pods_by_node(pods, nodes)
    incarnation = complete_incarnation(by_node, nodes)
    restarts = max(prev.restarts, incarnation or 0)
    failures = max(prev.failures, restarts)
    # ranks/ready/layoutChecked are the trainer's own report (rank 0: the whole group's): carried as read,
    # never rewritten here.
    status = TrainerStatus(restarts=restarts, failures=failures, ranks=prev.ranks, ready=prev.ready,
                           layout_checked=prev.layout_checked)
    if prev.last_failure is not None:
        status.last_failure = prev.last_failure
    plan = TrainerPlan(status=status)
    pending = failures > restarts
    what_pods = "the trainer pod" if nodes == 1 else f"the trainer group ({nodes} pods)"

    if ((by_node.get(0) or {}).get("status") or {}).get("phase") == "Succeeded":
        return plan  # rank 0 finished the run: whatever its followers do now is no failure of the trainer
    if not pending:
        failure = group_failure(by_node, nodes=nodes, phase=phase, pod_names=pod_names)
        if failure is None:
            missing = [n for n in range(nodes) if n not in by_node]
            if missing:  # the first pods (Pending), or ones deleted before the run ran: created again
                plan.create, plan.create_nodes = restarts, missing
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
                                 f"{failure.message[-800:]}\nrecreating {what_pods} in {backoff_s(restarts):g} s "
                                 f"(restart {restarts + 1} of {max_restarts})"))

    # A recreation is pending: wait out the backoff, delete every pod of the failed group (freeing their
    # names), then create the next incarnation of the whole group.
    failed_at = parse_time(status.last_failure.time if status.last_failure else None)
    due = (failed_at if failed_at is not None else now) + backoff_s(restarts)
    what = status.last_failure.reason if status.last_failure else reasons.TRAINER_FAILED
    stale = [view_pod(pod) for pod in by_node.values() if view_pod(pod).restarts <= restarts]
    if now < due:
        plan.restarting = f"{what}: recreating {what_pods} in {due - now:.0f} s (restart {restarts + 1} of " \
                          f"{max_restarts})"
        plan.requeue_after = due - now
    elif stale:
        plan.delete = [(view.name, view.uid) for view in stale if not view.terminating]
        names = ", ".join(view.name for view in stale)
        plan.restarting = f"{what}: deleting the failed trainer pod(s) {names} before recreating {what_pods}"
        plan.requeue_after = 2.0
    else:
        plan.create, plan.create_nodes = restarts + 1, [n for n in range(nodes) if n not in by_node]
        plan.restarting = f"{what}: recreating {what_pods} (restart {restarts + 1} of {max_restarts})"
        plan.events.append(Event("Normal", reasons.RECREATING_TRAINER,
                                 f"creating {', '.join(pod_names[n] for n in plan.create_nodes)} again (restart "
                                 f"{restarts + 1} of {max_restarts}); the trainer resumes from the newest complete "
                                 "checkpoint"))
        plan.requeue_after = 2.0
    return plan
