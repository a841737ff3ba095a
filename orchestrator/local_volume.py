"""The snapshot volume of a local run: a directory, on tmpfs when the machine has room there.

In Kubernetes the volume is the run's ReadWriteMany claim; locally every engine is a process on this
machine, so any directory works, and tmpfs (/dev/shm) makes writing and loading snapshots cost memory
bandwidth instead of disk I/O.
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
