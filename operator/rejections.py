"""Children the API server refused, as conditions and Events of their owner. Pure: no I/O, no clock.

A refusal for good (`Rejection.permanent`: 422, an admission rule) sets the owner's `Failed` condition
with reason ChildRejected and the server's message; a fleet then creates nothing more until its spec
changes (a new generation), so the refusal is not repeated every pass. A refusal that clears by
itself (quota exceeded, a missing ServiceAccount, a name held by a foreign object) sets `Degraded`
with reason ChildRejected and is retried with backoff. Either kind is one Warning Event, when the
condition first says it.

Foreign children (labelled as the owner's, not owned by its UID) are reported once each by an Event.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from rlfleet.crds import reasons
from rlfleet.kube.conditions import condition, find
from rlfleet.kube.refusals import Rejection
from rlfleet.operator.fleet_decide import Event


def _is_rejection(cond: dict | None) -> bool:
    return bool(cond and cond.get("status") == "True" and cond.get("reason") == reasons.CHILD_REJECTED)


def held(conditions: list[dict] | None, generation: int | None) -> dict | None:
    """The Failed ChildRejected condition still in force: set for this very generation of the spec."""
    failed = find(conditions, "Failed")
    if _is_rejection(failed) and failed is not None and failed.get("observedGeneration") == generation:
        return failed
    return None


def message(rejections: Sequence[Rejection]) -> str:
    return "\n".join(r.text() for r in rejections)


def carry(status: dict, previous: list[dict] | None, generation: int | None) -> dict:
    """`status` with the ChildRejected conditions of `previous` kept as they were: a held Failed one,
    and a Degraded one while its retry is pending (the pass's writes decide whether it clears)."""
    keep = {}
    if (failed := held(previous, generation)) is not None:
        keep["Failed"] = failed
        progressing = find(previous, "Progressing")
        if progressing is not None:
            keep["Progressing"] = progressing
    degraded = find(previous, "Degraded")
    if _is_rejection(degraded) and degraded is not None:
        keep["Degraded"] = degraded
    return _replace(status, keep)


def apply(status: dict, rejections: Sequence[Rejection], previous: list[dict] | None, *, now: float,
          generation: int | None) -> dict:
    """`status` showing the pass's refusals (permanent ones as Failed, the others as Degraded)."""
    permanent = [r for r in rejections if r.permanent]
    waiting = [r for r in rejections if not r.permanent]
    keep = {}
    if permanent:
        text = message(permanent)
        keep["Failed"] = condition("Failed", True, reasons.CHILD_REJECTED, text, now=now, previous=previous,
                                   generation=generation)
        keep["Progressing"] = condition("Progressing", False, reasons.CHILD_REJECTED, text, now=now,
                                        previous=previous, generation=generation)
    elif (failed := held(previous, generation)) is not None:
        keep["Failed"] = failed
    if waiting:
        keep["Degraded"] = condition("Degraded", True, reasons.CHILD_REJECTED, message(waiting), now=now,
                                     previous=previous, generation=generation)
    return _replace(status, keep)


def _replace(status: dict, conditions: dict[str, dict]) -> dict:
    if not conditions:
        return status
    current = status.get("conditions") or []
    merged = [conditions.get(c["type"], c) for c in current]
    merged += [c for kind, c in conditions.items() if not find(current, kind)]
    return {**status, "conditions": merged}


def events(rejections: Sequence[Rejection], previous: list[dict] | None) -> list[Event]:
    """One Warning per refusal not already shown by the owner's conditions (a retry says nothing new)."""
    shown = " ".join(c.get("message", "") for c in previous or [] if _is_rejection(c))
    return [Event("Warning", reasons.CHILD_REJECTED, r.text()[:1000]) for r in rejections if r.text() not in shown]


def foreign_events(owner_kind: str, owner_name: str, foreign: Iterable[tuple[str, dict]],
                   reported: set[str]) -> list[Event]:
    """One Warning per foreign (kind, object), by UID, not reported before; `reported` is updated."""
    out = []
    for kind, obj in foreign:
        uid = (obj.get("metadata") or {}).get("uid") or ""
        if not uid or uid in reported:
            continue
        reported.add(uid)
        name = obj["metadata"].get("name", "?")
        out.append(Event("Warning", reasons.FOREIGN_CHILD_IGNORED,
                         f"{kind} {name} is labelled as a child of {owner_kind} {owner_name} but not owned by it "
                         f"(no controller ownerReference with its UID): ignored, neither adopted nor deleted"))
    return out
