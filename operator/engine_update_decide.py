"""Which engine pods of a fleet to replace after an edit of its engine spec. Pure: no I/O, no clock.

A fleet of no run takes an edit of `spec.engine`, `spec.health` or `spec.snapshots` by replacing its engine
pods: each pod carries the digest of the spec it was built from (`rlfleet.io/engine-spec`). A pod that serves nothing
(Pending, Starting, or a slot out of budget) is replaced at once; a Ready one only while every other slot
is Ready or out of budget, lowest slot first, so the edit takes at most one serving engine away at a time.
A Dead slot is left to the restart policy, whose recreation builds the new spec anyway. Replacing a pod
for an edit is not a failure: it counts no restart.

A run's fleet is not replaced this way: its spec follows the run's, which is fixed once the run exists.
Pods without a digest (built by an earlier operator) are taken as current.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# States whose pod serves nothing: replacing it costs no capacity.
NOT_SERVING = ("Pending", "Starting", "Failed")
# States that let a Ready pod be replaced: nothing else is down or coming up.
SETTLED = ("Ready", "Failed")


@dataclass(frozen=True)
class SlotPod:
    """One slot as this decision sees it: its state this pass and the digest on its pod (None: no pod,
    or a pod without one)."""

    slot: int
    state: str
    digest: str | None


def outdated(slots: Sequence[SlotPod], current: str) -> list[int]:
    """Slots whose pod was built from another engine spec than `current`."""
    return [s.slot for s in slots if s.digest is not None and s.digest != current]


def slots_to_replace(slots: Sequence[SlotPod], current: str) -> list[int]:
    """The slots whose pods to delete now for the edit (each is created again from `current`)."""
    stale = set(outdated(slots, current))
    now = [s.slot for s in slots if s.slot in stale and s.state in NOT_SERVING]
    if now:
        return now
    serving = [s.slot for s in slots if s.slot in stale and s.state == "Ready"]
    if serving and all(s.state in SETTLED for s in slots):
        return serving[:1]
    return []
