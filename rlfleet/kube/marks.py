"""The orchestrator's marks on a fleet: the channel from the trainer pod to the operator. Pure.

The trainer's ServiceAccount may patch only the status of its fleets and run, never a spec or a pod
(a run's author chooses the code the trainer pod runs). What the orchestrator finds is written into
`status.orchestrator` of the fleet, a key the operator never writes (it writes the rest of the status):

- `engines.<slot>`: `{podUID, dead, deadMessage, weightVersion}`: the pod `podUID` of the slot is dead
  (the operator recreates the slot within its restart budget) or serves `weightVersion`; a mark names
  its pod, so a replacement pod starts unmarked;
- `modelPath`, `weightVersion`: the snapshot replacement engines start from, used only when it is a
  path under the fleet's snapshot mount (the run's own claim).

A run is failed by the orchestrator through `status.orchestratorFailure` of the TrainingRun.
"""
from __future__ import annotations

import posixpath

ORCHESTRATOR = "orchestrator"  # the fleet status key only the run's orchestrator writes
RUN_FAILURE = "orchestratorFailure"  # the TrainingRun status key only the run's orchestrator writes


def engine_marks(status: dict | None) -> dict[int, dict]:
    """The marks per slot (entries that are not a slot number or carry no pod UID are ignored)."""
    engines = ((status or {}).get(ORCHESTRATOR) or {}).get("engines") or {}
    if not isinstance(engines, dict):
        return {}
    return {int(k): v for k, v in engines.items()
            if isinstance(k, str) and k.isdigit() and isinstance(v, dict) and v.get("podUID")}


def mark_of(pod: dict, marks: dict[int, dict], slot: int | None) -> dict | None:
    """The mark of this very pod (same slot and UID), None for any other pod."""
    if slot is None:
        return None
    mark = marks.get(slot)
    uid = (pod.get("metadata") or {}).get("uid")
    return mark if mark is not None and uid and mark.get("podUID") == uid else None


def engine_mark_patch(slot: int, mark: dict) -> dict:
    """The status patch that sets one slot's whole mark (keys set to None are removed)."""
    return {"status": {ORCHESTRATOR: {"engines": {str(slot): mark}}}}


def pin_patch(model_path: str, weight_version: str) -> dict:
    """The status patch that pins the snapshot replacement engines start from."""
    return {"status": {ORCHESTRATOR: {"modelPath": model_path, "weightVersion": weight_version}}}


def run_failure_patch(reason: str, message: str) -> dict:
    return {"status": {RUN_FAILURE: {"reason": reason, "message": message}}}


def inside(path: str, root: str) -> bool:
    """`path` is `root` or below it, lexically (absolute, no `..` escaping it)."""
    if not path.startswith("/") or not root.startswith("/"):
        return False
    norm, base = posixpath.normpath(path), posixpath.normpath(root)
    return norm == base or norm.startswith(base.rstrip("/") + "/")


def pinned_snapshot(status: dict | None, mount_path: str | None) -> tuple[str, str] | None:
    """(model path, weight version) replacements start from: the orchestrator's pin when it lies under
    the fleet's snapshot mount, else None (the spec's model)."""
    marks = (status or {}).get(ORCHESTRATOR) or {}
    path = marks.get("modelPath")
    if not isinstance(path, str) or not path or mount_path is None or not inside(path, mount_path):
        return None
    return posixpath.normpath(path), str(marks.get("weightVersion") or "0")
