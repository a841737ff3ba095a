"""The snapshot volume of a local run: a directory, on tmpfs when the machine has room there.

In Kubernetes the volume is the run's ReadWriteMany claim; locally every engine is a process on this
machine, so any directory works, and tmpfs (/dev/shm) makes writing and loading snapshots cost memory
bandwidth instead of disk I/O. A volume there is scratch: the run removes it when it ends (its
summary has already counted what was left); set `weightSync.snapshotVolume.localPath` to keep snapshots.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

TMPFS = Path("/dev/shm")
MIN_TMPFS_FREE_BYTES = 2 * 1024**3


def default_local_volume(run_dir: str | os.PathLike, *, tmpfs: Path = TMPFS,
                         min_free_bytes: int = MIN_TMPFS_FREE_BYTES) -> Path:
    """`/dev/shm/rlfleet/<run-dir-name>-<hash>` when tmpfs is writable with room, else `<run_dir>/snapshots`."""
    run_dir = Path(run_dir)
    try:
        if tmpfs.is_dir() and os.access(tmpfs, os.W_OK) and shutil.disk_usage(tmpfs).free >= min_free_bytes:
            tag = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:10]
            return tmpfs / "rlfleet" / f"{run_dir.name}-{tag}"
    except OSError:
        pass
    return run_dir / "snapshots"


def is_scratch_volume(path: str | os.PathLike, *, tmpfs: Path = TMPFS) -> bool:
    """A volume `default_local_volume` put on tmpfs."""
    return Path(path).is_relative_to(tmpfs / "rlfleet")
