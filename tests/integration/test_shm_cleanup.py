"""`orphaned_semaphores`: what the engine helpers remove from /dev/shm after an engine stops;
`sweep_orphaned_shm`: what a starting fleet removes that engines killed with their run left there.

Real POSIX semaphores from multiprocessing (the kind the rank launcher and SGLang make). A semaphore its
creator still holds must never be taken for garbage, though the creator maps it under the temporary
name glibc made it in: removing it broke a run on the other test worker, whose ranks could not open
their launcher's semaphores by name.
"""
from __future__ import annotations

import _multiprocessing
import mmap
import multiprocessing
import os
import time
from pathlib import Path

from rlfleet.util.procs import (
    LOADS_PREFIX,
    SHM_DIR,
    SHM_SWEEP_MIN_AGE_S,
    list_shm,
    orphaned_semaphores,
    sweep_orphaned_shm,
)


def _file(lock) -> Path:
    return SHM_DIR / ("sem." + lock._semlock.name.lstrip("/"))


def test_a_semaphore_its_creator_holds_is_not_orphaned() -> None:
    before = frozenset(list_shm())
    lock = multiprocessing.get_context("spawn").Lock()
    path = _file(lock)
    assert path.exists()
    assert path not in orphaned_semaphores(since=before)


def test_a_semaphore_a_spawned_child_opened_is_not_orphaned() -> None:
    context = multiprocessing.get_context("spawn")
    before = frozenset(list_shm())
    done = context.Event()
    made = {SHM_DIR / name for name in list_shm() - before}
    assert made, "the event made no semaphore"
    # The child opens the parent's semaphores by name, as a rank does, and holds them until `done`.
    child = context.Process(target=done.wait, args=(60,))
    child.start()
    try:
        deadline = time.monotonic() + 60
        while not any(str(path) in Path(f"/proc/{child.pid}/maps").read_text() for path in made):
            assert time.monotonic() < deadline and child.is_alive(), "the child never opened the semaphores"
            time.sleep(0.1)
        assert not made & orphaned_semaphores(since=before)
    finally:
        done.set()
        child.join(30)


def test_an_abandoned_semaphore_is_orphaned_and_older_ones_are_left_alone() -> None:
    older = multiprocessing.get_context("spawn").Lock()  # listed in `before`: never a candidate
    before = frozenset(list_shm())
    name = f"/mp-rlfleet-test-{os.getpid()}"
    abandoned = SHM_DIR / f"sem{name.replace('/', '.')}"
    semaphore = _multiprocessing.SemLock(1, 1, 1, name, False)  # named, not unlinked: left behind on close
    del semaphore
    try:
        found = orphaned_semaphores(since=before)
        assert abandoned in found
        assert _file(older) not in found
    finally:
        abandoned.unlink(missing_ok=True)


def _loads_file(tag: str, age_s: float) -> Path:
    path = SHM_DIR / f"{LOADS_PREFIX}rlfleet-test-{os.getpid()}-{tag}.shm"
    path.write_bytes(b"\0" * 16396)
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_the_sweep_removes_only_old_files_no_process_maps() -> None:
    old = SHM_SWEEP_MIN_AGE_S + 60
    abandoned = _loads_file("abandoned", old)  # what a SIGKILLed engine leaves
    young = _loads_file("young", 1)  # an engine may still be setting it up
    mapped = _loads_file("mapped", old)  # a live engine's, unchanged for a while
    abandoned_lock = SHM_DIR / f"sem.mp-rlfleet-test-{os.getpid()}"
    semaphore = _multiprocessing.SemLock(1, 1, 1, f"/mp-rlfleet-test-{os.getpid()}", False)
    del semaphore
    os.utime(abandoned_lock, (time.time() - old, time.time() - old))
    held = multiprocessing.get_context("spawn").Lock()  # in use, however old
    os.utime(_file(held), (time.time() - old, time.time() - old))
    try:
        with mapped.open("r+b") as f:
            view = mmap.mmap(f.fileno(), 0)  # the file closed, only the mapping holds it, as SGLang's
        try:
            removed = set(sweep_orphaned_shm())
            # Gone, whichever sweep took them: a fleet starting on the other test worker sweeps too.
            assert not abandoned.exists() and not abandoned_lock.exists()
            assert young.exists() and mapped.exists() and _file(held).exists()
            assert not {young, mapped, _file(held)} & removed
        finally:
            view.close()
    finally:
        for path in (abandoned, young, mapped, abandoned_lock):
            path.unlink(missing_ok=True)
