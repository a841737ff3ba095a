"""Child processes in their own session, stopped by process group, with captured logs.

SGLang leaves children behind and can ignore SIGTERM for minutes (a taken port), so every process
runs under setsid and is stopped with SIGTERM to the group, then SIGKILL after a grace period.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Awaitable, Iterator, Mapping
from pathlib import Path

from rlfleet.util.redact import redact_lines

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL when the parent dies (even by SIGKILL), so a killed test
    run or supervisor cannot leave its process groups behind (they run in sessions of their own)."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def die_with_parent(parent: int) -> None:
    """In a process started by `parent` (a rank the launcher spawned): get SIGKILL when the parent dies,
    and go at once if it is already gone (it died before the request was made)."""
    _die_with_parent()
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


# How long a stopped group's SIGKILLed processes may take to go before we stop waiting for them.
GROUP_EXIT_TIMEOUT_S = 10.0
# Reaps still waiting for a SIGKILLed leader that did not go in time (held here: the loop keeps only
# weak references to its tasks).
_reaping: set[asyncio.Future] = set()


async def reap_within(wait: Awaitable[int], timeout_s: float = GROUP_EXIT_TIMEOUT_S) -> int | None:
    """The exit status from `wait` (a SIGKILLed leader's reap), or None after `timeout_s`: a process in
    uninterruptible sleep (a hung device or file system) goes only when that ends, perhaps never. The
    reap goes on in the background then, and a cancel of the caller does not stop it either."""
    reap = asyncio.ensure_future(wait)
    try:
        async with asyncio.timeout(timeout_s):
            return await asyncio.shield(reap)
    except TimeoutError:
        pass
    finally:
        if not reap.done():
            _reaping.add(reap)
            reap.add_done_callback(_reaped)
    return None


def _reaped(reap: asyncio.Future) -> None:
    _reaping.discard(reap)
    if not reap.cancelled():
        reap.exception()  # retrieved: a failed background reap is not reported as never retrieved



# What this process's environment held before the trainer's own variables were set in it (JSON: name ->
# value, null for unset): the engines and routers a run starts get the environment `rlfleet run` was started
# with, not the trainer's settings (spec.trainer.env), as on Kubernetes where they run in pods of their own.
OUTER_ENV = "RLFLEET_OUTER_ENV"


def set_trainer_environment(values: Mapping[str, str]) -> None:
    """Set the trainer's variables in this process's environment (its rank processes inherit them), once:
    a rank process that inherited them keeps the launcher's record of what they replaced."""
    if not values or OUTER_ENV in os.environ:
        return
    os.environ[OUTER_ENV] = json.dumps({name: os.environ.get(name) for name in values})
    os.environ.update(values)


def outer_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` as it was before `set_trainer_environment`: what a process this one starts inherits."""
    env = dict(environ)
    replaced: dict[str, str | None] = json.loads(env.pop(OUTER_ENV, "") or "{}")
    for name, value in replaced.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


class _ProcessGroup:
    """What both process kinds share: the child's set-up, its group's signals, the stop rule, its log.

    A subclass supplies only the parts that block or await: start, returncode and stop's two waits.
    """

    die_with_parent_default = False

    def __init__(self, name: str, argv: list[str], *, log_path: Path, env: dict[str, str] | None = None,
                 cwd: str | None = None, die_with_parent: bool | None = None, inherit_env: bool = True):
        self.name = name
        self.argv = argv
        self.log_path = Path(log_path)
        self.env = env
        self.inherit_env = inherit_env  # False: `env` is the child's whole environment
        self.cwd = cwd
        self.die_with_parent = self.die_with_parent_default if die_with_parent is None else die_with_parent
        self.proc: asyncio.subprocess.Process | subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        raise NotImplementedError

    @contextlib.contextmanager
    def _spawn_options(self) -> Iterator[dict]:
        """Keyword arguments for Popen and create_subprocess_exec alike: a session of its own, no stdin,
        stdout and stderr appended to the log file (open only while the child is spawned)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            yield {
                "stdin": subprocess.DEVNULL,
                "stdout": log,
                "stderr": subprocess.STDOUT,
                "env": {**(outer_environment(os.environ) if self.inherit_env else {}), **(self.env or {})},
                "cwd": self.cwd,
                "start_new_session": True,
                "preexec_fn": _die_with_parent if self.die_with_parent else None,
            }

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def _terminate(self) -> bool:
        """Stop's first step: SIGTERM the group while the leader runs; True when there is an exit to wait for."""
        if self.returncode is not None:
            return False
        self.signal_group(signal.SIGTERM)
        return True

    def _kill(self) -> None:
        """Stop's last step, always taken: the leader may be gone while children (scheduler, detokenizer)
        linger, or the group may be stopped (SIGSTOP), so continue it and SIGKILL it."""
        self.signal_group(signal.SIGCONT)
        self.signal_group(signal.SIGKILL)

    def tail(self, lines: int = 20) -> list[str]:
        return tail_file(self.log_path, lines)


class ManagedProcess(_ProcessGroup):
    """One child process group with its output appended to a log file."""

    proc: asyncio.subprocess.Process | None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc else None

    async def start(self) -> None:
        with self._spawn_options() as options:
            self.proc = await asyncio.create_subprocess_exec(*self.argv, **options)

    async def wait(self) -> int:
        assert self.proc is not None
        return await self.proc.wait()

    async def stop(self, grace_s: float = 8.0) -> int | None:
        """SIGTERM the group, SIGKILL it after grace_s; always reaps. Safe to call twice."""
        if self.proc is None:
            return None
        try:
            if self._terminate():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(grace_s):
                        await self.proc.wait()
        finally:
            self._kill()
            with contextlib.suppress(ProcessLookupError):
                if await reap_within(self.proc.wait()) is None:
                    log.warning("%s (pid %d) did not exit within %g s of SIGKILL (uninterruptible sleep?); "
                                "still reaping it in the background", self.name, self.proc.pid,
                                GROUP_EXIT_TIMEOUT_S)
        return self.proc.returncode


def tail_file(path: Path, lines: int = 20) -> list[str]:
    """The last non-empty lines of a log file ([] when it does not exist), keys and tokens redacted."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return []
    kept: deque[str] = deque(maxlen=lines)
    for line in text.splitlines():
        if line.strip():
            kept.append(line.rstrip())
    return redact_lines(kept)


def groups_writing_under(directory: Path) -> set[int]:
    """Process groups with a live process whose stdout is a file under `directory` (our children log
    there), found from /proc even after whoever started them is gone."""
    prefix = str(Path(directory).resolve()) + "/"
    groups = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/fd/1").startswith(prefix):
                    groups.add(os.getpgid(int(entry)))
    return groups


def pod_process_groups(data_dir: Path) -> set[int]:
    """Process groups of the node agent's pods that are still running.

    The node agent (rlfleet.devcluster.node_agent.agent) sends each container's output to a file under
    `<data_dir>/logs/`; pods run in sessions of their own, so this finds them even after the agent
    itself is gone.
    """
    return groups_writing_under(Path(data_dir) / "logs")


def kill_pod_process_groups(data_dir: Path) -> int:
    """SIGKILL every pod process group of the node agent with data_dir still running; returns how many."""
    left = pod_process_groups(data_dir)
    for pgid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    return len(left)


def group_alive(pgid: int) -> bool:
    """True while any process of the group exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class GroupProcess(_ProcessGroup):
    """The blocking twin of ManagedProcess, for code without an event loop (the local control plane).

    Same rules: own session, output appended to a log file, stop = SIGTERM the group then SIGKILL.
    """

    die_with_parent_default = True
    proc: subprocess.Popen | None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def start(self) -> None:
        with self._spawn_options() as options:
            self.proc = subprocess.Popen(self.argv, **options)

    def stop(self, grace_s: float = 8.0) -> int | None:
        """SIGTERM the group, SIGKILL it after grace_s; always reaps, and waits (bounded) until no process
        of the group is left. Safe to call twice."""
        if self.proc is None:
            return None
        try:
            if self._terminate():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(grace_s)
        finally:
            self._kill()
            try:
                self.proc.wait(GROUP_EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:  # a later returncode (poll) reaps it
                log.warning("%s (pid %d) did not exit within %g s of SIGKILL (uninterruptible sleep?)",
                            self.name, self.proc.pid, GROUP_EXIT_TIMEOUT_S)
            deadline = time.monotonic() + GROUP_EXIT_TIMEOUT_S
            while group_pids(self.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)  # SIGKILLed children take a moment to go
        return self.proc.returncode


# --- /proc scans ------------------------------------------------------------------------------------

SHM_DIR = Path("/dev/shm")
# SGLang's load-snapshot files (mapped by the scheduler while it runs) and multiprocessing semaphores
# (left behind because SGLang SIGKILLs its own resource tracker on shutdown).
LOADS_PREFIX = "sglang_loads_"
SEMAPHORE_PREFIX = "sem.mp-"


def shm_files_of_group(pgid: int, prefixes: tuple[str, ...] = (LOADS_PREFIX, SEMAPHORE_PREFIX)) -> set[Path]:
    """The /dev/shm files named with one of `prefixes` that any process of the group maps or holds open."""
    found = set()
    for pid in group_pids(pgid):
        found |= {path for path, _ in _shm_files_of(pid) if path.name.startswith(prefixes)}
    return found


def mapped_shm_files(pgid: int) -> set[Path]:
    """SGLang load-snapshot files that any process of the group has open or mapped."""
    return shm_files_of_group(pgid, (LOADS_PREFIX,))


def orphaned_semaphores(since: frozenset[str]) -> set[Path]:
    """Multiprocessing semaphores created after `since` was listed that no live process maps any more."""
    return orphaned_shm_files((SEMAPHORE_PREFIX,), since=since)


def orphaned_shm_files(prefixes: tuple[str, ...], *, since: frozenset[str] = frozenset(),
                       older_than_s: float = 0.0) -> set[Path]:
    """/dev/shm files named with one of `prefixes`, not listed in `since`, last changed over
    `older_than_s` ago and owned by this user, that no live process maps or holds open.

    SGLang's load-snapshot files and semaphores are in use exactly while some process maps them, so an
    unmapped one is garbage (its processes were SIGKILLed). Matched by inode, not by name: the process
    that created a semaphore maps the temporary file glibc made it in (`/dev/shm/sem.XXXXXX (deleted)`),
    which became the named one by a link; a name-only match takes a live semaphore for garbage, and a
    process that opens it by name later (a spawned child) fails.
    """
    new = {SHM_DIR / name for name in list_shm() - since if name.startswith(prefixes)}
    if not new:
        return set()
    in_use: set[int] = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            in_use |= {inode for _, inode in _shm_files_of(int(entry))}
    now = time.time()
    orphaned = set()
    for path in new:
        with contextlib.suppress(OSError):  # gone meanwhile: nothing to remove
            st = path.stat()
            if st.st_ino not in in_use and st.st_uid == os.getuid() and now - st.st_mtime >= older_than_s:
                orphaned.add(path)
    return orphaned


# A file younger than this may belong to a process that is still setting it up (created, not mapped yet).
SHM_SWEEP_MIN_AGE_S = 60.0


def sweep_orphaned_shm() -> list[Path]:
    """Remove the SGLang load-snapshot files and semaphores that engines killed with their run (SIGKILL
    leaves no one to unlink them) left in /dev/shm; blocking (/proc scan): call it in a thread."""
    removed = []
    for path in sorted(orphaned_shm_files((LOADS_PREFIX, SEMAPHORE_PREFIX), older_than_s=SHM_SWEEP_MIN_AGE_S)):
        with contextlib.suppress(FileNotFoundError, PermissionError):
            path.unlink()
            removed.append(path)
    return removed


def list_shm() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except OSError:
        return set()


def _shm_files_of(pid: int) -> set[tuple[Path, int]]:
    """(path, inode) of each /dev/shm file a process maps or holds open, the path as the process named it."""
    found: set[tuple[Path, int]] = set()
    prefix = str(SHM_DIR) + "/"
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)  # address perms offset device inode [path]
            if len(parts) == 6 and parts[5].startswith(prefix):
                found.add((Path(parts[5].removesuffix(" (deleted)")), int(parts[4])))
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    found.add((Path(target.removesuffix(" (deleted)")), os.stat(f"/proc/{pid}/fd/{fd}").st_ino))
    return found


def group_pids(pgid: int) -> list[int]:
    """The live (not zombie) processes whose process group is pgid, read from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            # Fields after the parenthesised command: state ppid pgrp ...
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry))
    return pids
