"""weightSync.keepSnapshots: which step snapshots a run removes."""
from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.snapshot.retention import snapshots_to_retire

STEPS = [Path(f"/volume/step_{n}") for n in range(6)]


@pytest.mark.parametrize(("keep", "kept", "retired"), [
    (1, STEPS[5:], STEPS[1:5]),
    (2, STEPS[4:], STEPS[1:4]),
    (5, STEPS[1:], []),
    (9, STEPS[1:], []),
])
def test_the_newest_keep_stay_and_the_launch_weights_are_never_counted_or_removed(keep, kept, retired):
    assert snapshots_to_retire(STEPS, keep, never=frozenset({STEPS[0]})) == (kept, retired)


def test_one_step_at_a_time_removes_the_oldest_beyond_keep():
    kept: list[Path] = []
    removed: list[Path] = []
    for path in STEPS:
        kept, retired = snapshots_to_retire([*kept, path], 2)
        removed += retired
    assert kept == STEPS[4:] and removed == STEPS[:4]


def test_keep_below_one_is_refused():
    with pytest.raises(ValueError, match="keep must be at least 1"):
        snapshots_to_retire(STEPS, 0)
