"""`rlfleet run` as a user starts it: a subprocess on a TrainingRun YAML derived from the quickstart."""
from __future__ import annotations

import contextlib
import copy
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _merge(base: dict, changes: dict) -> dict:
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def write_manifest(path: Path, *, steps: int = 1000, replicas: int = 1, rollout: dict | None = None,
                   spec: dict | None = None, eval_on: bool = False) -> Path:
    """The quickstart with `steps` (default: still training when a signal comes), `replicas` engines,
    no eval unless `eval_on`, and `rollout` / `spec` merged in (nested dicts merge)."""
    manifest: dict[str, Any] = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    manifest["spec"]["trainer"]["steps"] = steps
    manifest["spec"]["rollout"]["replicas"] = replicas
    if not eval_on:
        del manifest["spec"]["eval"]
    _merge(manifest["spec"]["rollout"], rollout or {})
    _merge(manifest["spec"], spec or {})
    path.write_text(yaml.safe_dump(manifest))
    return path


def start_cli_run(tmp_path: Path, *, manifest: Path | None = None, args: tuple[str, ...] = (), tag: str = "run",
                  **manifest_options) -> tuple[subprocess.Popen, Path, Path]:
    """`rlfleet run MANIFEST --run-dir <tmp>/<tag> --metrics-port 0 ARGS`; output to <tmp>/<tag>.log.

    Without `manifest`, one is written from the quickstart (`write_manifest`'s options). Returns the
    process, its run directory and its output file."""
    if manifest is None:
        manifest = write_manifest(tmp_path / f"{tag}.yaml", **manifest_options)
    run_dir = tmp_path / tag
    out = tmp_path / f"{tag}.log"
    with out.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "rlfleet.cli", "run", str(manifest), "--run-dir",
                                 str(run_dir), "--metrics-port", "0", *args],
                                stdout=sink, stderr=subprocess.STDOUT, text=True)
    return proc, run_dir, out


# What an interpreter prints while it shuts down after its multiprocessing helpers (the rank launcher's
# queues and events): pages of it can follow, and hide, the line that says why a run failed. The
# resource tracker's warnings, a line each, and the tracebacks of semaphore finalizers, whole.
_TRACKER_NOISE = ("multiprocessing/resource_tracker.py", "warnings.warn('resource_tracker")
_FINALIZER_TRACEBACK = "Exception ignored in: <Finalize object"


def _without_shutdown_noise(output: str) -> list[str]:
    kept: list[str] = []
    in_finalizer = False
    for line in output.splitlines():
        if _FINALIZER_TRACEBACK in line:
            in_finalizer = True
        elif in_finalizer:
            # The traceback's own lines are indented or its header; its last line names the error.
            in_finalizer = line.startswith((" ", "Traceback (most recent call last):"))
        elif not any(noise in line for noise in _TRACKER_NOISE):
            kept.append(line)
    return kept


def failure_excerpt(output: str, chars: int = 3000) -> str:
    """What to show when a run did not do what a test expected: the end of its output without the
    interpreter's shutdown noise, and its `FAILED` line (with what led to it) wherever that is."""
    tail = "\n".join(_without_shutdown_noise(output))[-chars:]
    failed = output.rfind("rlfleet run: FAILED")
    if failed >= 0 and output[failed:failed + 200] not in tail:
        tail = output[max(0, failed - chars // 2):failed + chars // 2] + "\n[...]\n" + tail[-chars // 2:]
    return tail


def wait_output(proc: subprocess.Popen, out: Path, text: str, timeout_s: float = 900) -> None:
    """Until `text` is in the run's output; fails if the run exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while text not in out.read_text():
        assert proc.poll() is None, failure_excerpt(out.read_text())
        assert time.monotonic() < deadline, failure_excerpt(out.read_text())
        time.sleep(0.2)


def cli_run_pid(run_dir: Path) -> int:
    """The `rlfleet run` process started with `--run-dir run_dir` (found in /proc: a tmux pane's child)."""
    wanted = str(run_dir).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if b"rlfleet.cli" in argv and b"run" in argv and wanted in argv:
            return int(entry.name)
    raise LookupError(f"no rlfleet run process with --run-dir {run_dir}")


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a run's ranks, when it launched them; not their engines)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        if parent == pid:
            found.append(int(entry.name))
    return found


@contextlib.contextmanager
def held(*pids: int) -> Iterator[None]:
    """The processes stopped (SIGSTOP) inside the block and let go after it, whatever the block raises
    (one killed inside it is skipped): an event lands while the run is between two known steps, however
    fast its steps are."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # gone since it was found
            os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
