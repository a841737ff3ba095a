"""Which weight snapshots a run removes: `weightSync.keepSnapshots` newest stay on the volume."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def snapshots_to_retire(kept: Sequence[Path], keep: int, *, never: frozenset[Path] = frozenset()
                        ) -> tuple[list[Path], list[Path]]:
    """(still kept, to remove) of the run's snapshots, oldest first, so that the `keep` newest stay.

    `never`: snapshots the run does not own (the launch weights: step_0, or a resumed run's checkpoint);
    they are neither counted nor removed."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the snapshot engines serve), got {keep}")
    owned = [path for path in kept if path not in never]
    cut = max(0, len(owned) - keep)
    return owned[cut:], owned[:cut]
