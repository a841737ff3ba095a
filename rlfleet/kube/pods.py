"""Reading an engine pod: why it cannot serve, and what a decision needs of it. Pure; shared by the
operator (recreation decisions) and the orchestrator's Kubernetes backend (death detection)."""
from __future__ import annotations

from dataclasses import dataclass

from rlfleet.crds import conventions, reasons
from rlfleet.kube.conditions import parse_time, reason_word
from rlfleet.kube.marks import mark_of
from rlfleet.util.redact import redact

# Waiting reasons that never resolve by waiting: the slot is dead.
START_FAILURES = frozenset({"InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError",
                            "CreateContainerError", "ImageNotMapped", "RunContainerError"})
FAILURE_MESSAGE_MAX = 4096


@dataclass(frozen=True)
class Failure:
    reason: str
    message: str
    exit_code: int | None = None


@dataclass(frozen=True)
class PodView:
    """What the decision needs of one engine pod."""

    name: str
    uid: str
    slot: int | None
    restarts: int
    phase: str
    ready: bool
    terminating: bool
    pod_ip: str | None
    created: float | None
    failure: Failure | None
    weight_version: str | None
    engine_spec: str | None = None  # the digest of the fleet spec it was built from (None: an older operator's)


def int_or(value, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def pod_failure(pod: dict, mark: dict | None = None) -> Failure | None:
    """Why this pod cannot serve, from its status and the orchestrator's dead mark (None: it can).

    `mark`: the orchestrator's mark of this pod (`rlfleet.kube.marks.mark_of`), if any. The message
    quotes the container's last log lines (its termination message): keys and tokens redacted."""
    failure = _pod_failure(pod, mark)
    return None if failure is None else Failure(failure.reason, redact(failure.message), failure.exit_code)


def _pod_failure(pod: dict, mark: dict | None) -> Failure | None:
    status = pod.get("status") or {}
    statuses = (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])
    terminated = next((s["state"]["terminated"] for s in statuses
                       if (s.get("state") or {}).get("terminated")
                       and s["state"]["terminated"].get("exitCode", 0) != 0),
                      None)
    if terminated is None and status.get("phase") in ("Failed", "Succeeded"):
        terminated = next((s["state"]["terminated"] for s in statuses if (s.get("state") or {}).get("terminated")),
                          {"exitCode": None, "message": status.get("message", "")})
    if mark is not None and mark.get("dead"):
        code = terminated.get("exitCode") if terminated else None
        seen = mark.get("deadMessage") or ""
        if terminated and code:  # the container's own exit, when known, says more than what its clients saw
            said = f"orchestrator: {reason_word(mark['dead'], reasons.MARKED_DEAD)}: {seen}".rstrip(": ")
            return Failure(reasons.CRASHED, f"{said}\n{terminated.get('message') or ''}".strip(), code)
        message = seen
        if terminated and terminated.get("message"):
            message = f"{message}\n{terminated['message']}".strip()
        return Failure(reason_word(mark["dead"], reasons.MARKED_DEAD), message, code)
    if terminated is not None:
        code = terminated.get("exitCode")
        reason = reasons.EXITED if code == 0 else reasons.CRASHED
        return Failure(reason, terminated.get("message") or terminated.get("reason") or "", code)
    if status.get("phase") in ("Failed", "Succeeded"):
        return Failure(reasons.POD_FAILED, status.get("message") or status.get("reason") or "")
    for s in statuses:
        waiting = (s.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in START_FAILURES:
            return Failure(waiting["reason"], waiting.get("message", ""))
    return None


def view_pod(pod: dict, mark: dict | None = None) -> PodView:
    """`mark`: the orchestrator's mark of this pod (dead, weight version), if any."""
    meta, status = pod["metadata"], pod.get("status") or {}
    labels, ann = meta.get("labels") or {}, meta.get("annotations") or {}
    slot_label = labels.get(conventions.LABEL_SLOT, "")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    return PodView(
        name=meta["name"], uid=meta.get("uid", ""),
        slot=int(slot_label) if slot_label.isdigit() else None,
        restarts=int_or(ann.get(conventions.ANN_RESTARTS)),
        phase=status.get("phase", "Pending"), ready=ready and status.get("phase") == "Running",
        terminating=bool(meta.get("deletionTimestamp")),
        pod_ip=status.get("podIP"), created=parse_time(meta.get("creationTimestamp")),
        failure=pod_failure(pod, mark), weight_version=(mark or {}).get("weightVersion"),
        engine_spec=ann.get(conventions.ANN_ENGINE_SPEC),
    )


def slot_of(pod: dict) -> int | None:
    """The slot label of an engine pod (None when it has none)."""
    label = ((pod.get("metadata") or {}).get("labels") or {}).get(conventions.LABEL_SLOT, "")
    return int(label) if label.isdigit() else None


def view_marked(pod: dict, marks: dict[int, dict]) -> PodView:
    """`view_pod` with the orchestrator's mark of this pod (`marks`: `rlfleet.kube.marks.engine_marks`)."""
    return view_pod(pod, mark_of(pod, marks, slot_of(pod)))
