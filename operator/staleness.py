"""A daemon's body older than the status the operator itself last wrote. Pure: no I/O, no clock.

Kopf keeps a daemon's body current from the watch stream, which may deliver a reconcile's own status
writes (two when a child is refused: the pass's status, then the refusal) after the next pass has
begun. A pass on such a body decides again from a status the operator has already replaced: a child
refused for good is created and refused again, with a second Event. The versions a pass leaves behind
are remembered; a pass whose body still shows one of them waits for the newer one, for a bounded time
(a watch that never delivers it must not stop the object's reconciles).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

STALE_RETRY_S = 0.2  # how soon a pass put off for a stale body looks again
STALE_WAIT_MAX_S = 5.0  # after this, a body that still shows a superseded version is reconciled as it is


def superseded(started_from: str | None, written: Sequence[str | None]) -> frozenset[str]:
    """The resourceVersions a body may still show after a pass that started from `started_from` and wrote
    the status versions `written` in order (None: that write was not needed): all but the last written;
    none when the pass wrote nothing."""
    versions = [v for v in written if v]
    if not versions:
        return frozenset()
    return frozenset(v for v in (started_from, *versions[:-1]) if v)


@dataclass(frozen=True)
class LeftBehind:
    """What a pass superseded, and until when (the loop's clock) a body showing it is put off."""

    versions: frozenset[str]
    until: float

    def puts_off(self, version: str | None, now: float) -> bool:
        return version in self.versions and now < self.until
