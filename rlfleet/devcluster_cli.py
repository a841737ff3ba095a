"""`rlfleet dev-cluster up|down|status`: a local Kubernetes control plane that outlives the command.

`up` starts a detached supervisor process (`_serve`) that runs the control plane (rlfleet.devcluster)
and records its state, including every PID, in <dir>/state.json; `up` returns once the API server is
ready. `down` sends the supervisor SIGTERM (it stops its children), then makes sure that no recorded
process is left, and removes the directory unless --keep.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlfleet.procs import tail_file
from rlfleet.tools import CACHE_DIR, MissingTool, tool_path

DEFAULT_NAME = "dev"
STATE_FILE = "state.json"
SUPERVISOR_LOG = "supervisor.log"
STOP_TIMEOUT_S = 40.0


def default_dir(name: str) -> Path:
    return CACHE_DIR / "clusters" / name


# ---- state file ----------------------------------------------------------------------------------

def read_state(directory: Path) -> dict | None:
    try:
        return json.loads((directory / STATE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write_state(directory: Path, state: dict) -> None:
    path = directory / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(path)


# ---- processes -----------------------------------------------------------------------------------

def process_alive(pid: int | None) -> bool:
    """True if pid runs (a zombie, dead but not yet reaped, counts as gone)."""
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _is_ours(pid: int, marker: str) -> bool:
    """Guard against PID reuse: only signal a process whose command line still names what we started."""
    return process_alive(pid) and marker in _cmdline(pid)


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    members.append(int(entry))
    return members


def _leftovers(state: dict) -> list[str]:
    """Recorded processes (supervisor, and each component's whole process group) still alive."""
    left = []
    supervisor = state.get("supervisor_pid")
    if supervisor and _is_ours(supervisor, "devcluster_cli"):
        left.append(f"supervisor pid {supervisor}")
    for component in state.get("components", []):
        for pid in _group_members(component["pid"]):
            left.append(f"{component['name']} pid {pid}")
    return left


def _wait_gone(state: dict, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := _leftovers(state)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


# ---- commands ------------------------------------------------------------------------------------

def cmd_up(args: argparse.Namespace) -> int:
    directory = args.dir
    state = read_state(directory)
    if state and process_alive(state.get("supervisor_pid")) and state.get("status") in ("starting", "ready"):
        print(f"dev cluster {args.name!r} is already running ({directory})")
        _print_usage(args.name, state)
        return 0
    if state:  # a stale directory from a crashed supervisor: clear it out first
        _force_stop(state)
        shutil.rmtree(directory)
    elif directory.exists() and any(directory.iterdir()):
        print(f"error: {directory} exists and is not a dev cluster directory; choose another --dir", file=sys.stderr)
        return 1
    try:
        for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl"):
            tool_path(name)
    except MissingTool as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    directory.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-P", "-m", "rlfleet.devcluster_cli", "_serve", "--name", args.name,
            "--dir", str(directory), "--timeout", str(args.timeout)]
    with open(directory / SUPERVISOR_LOG, "ab") as log:
        supervisor = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                      cwd=str(directory), start_new_session=True)
    deadline = time.monotonic() + args.timeout + 30
    while time.monotonic() < deadline:
        state = read_state(directory) or {}
        if state.get("status") == "ready":
            print(f"dev cluster {args.name!r} is ready: {state['server']}")
            _print_usage(args.name, state)
            return 0
        if state.get("status") == "failed" or supervisor.poll() is not None:
            supervisor.wait()
            reason = state.get("error") or "\n".join(tail_file(directory / SUPERVISOR_LOG, 20))
            print(f"error: dev cluster {args.name!r} failed to start: {reason}", file=sys.stderr)
            _force_stop(state or {"supervisor_pid": supervisor.pid})
            shutil.rmtree(directory, ignore_errors=True)
            return 1
        time.sleep(0.25)
    print(f"error: dev cluster {args.name!r} was not ready after {args.timeout:.0f} s; stopping it", file=sys.stderr)
    _force_stop(read_state(directory) or {"supervisor_pid": supervisor.pid})
    shutil.rmtree(directory, ignore_errors=True)
    return 1


def cmd_down(args: argparse.Namespace) -> int:
    directory = args.dir
    state = read_state(directory)
    if state is None:
        print(f"dev cluster {args.name!r} is not running (no state in {directory})")
        return 0
    left = _force_stop(state)
    if left:
        print(f"error: processes still alive after stop: {', '.join(left)}", file=sys.stderr)
        return 1
    if args.keep:
        write_state(directory, {**state, "status": "stopped"})
        print(f"dev cluster {args.name!r} stopped; data kept in {directory}")
    else:
        shutil.rmtree(directory, ignore_errors=True)
        print(f"dev cluster {args.name!r} stopped and removed")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    state = read_state(args.dir)
    if state is None:
        print(f"dev cluster {args.name!r}: not running")
        return 1
    running = state.get("status") == "ready" and process_alive(state.get("supervisor_pid"))
    print(f"dev cluster {args.name!r}: {'running' if running else state.get('status', 'unknown')}")
    print(f"  directory:  {args.dir}")
    if state.get("server"):
        print(f"  server:     {state['server']}")
        print(f"  kubeconfig: {state['kubeconfig']}")
    if state.get("error"):
        print(f"  error:      {state['error']}")
    print(f"  supervisor: pid {state.get('supervisor_pid')} ({'alive' if process_alive(state.get('supervisor_pid')) else 'gone'})")
    for component in state.get("components", []):
        alive = "alive" if process_alive(component["pid"]) else "gone"
        print(f"  {component['name']}: pid {component['pid']} ({alive}), log {component['log']}")
    return 0 if running else 1


def _force_stop(state: dict) -> list[str]:
    """SIGTERM the supervisor and wait; then SIGKILL anything recorded that is still alive."""
    supervisor = state.get("supervisor_pid")
    if supervisor and _is_ours(supervisor, "devcluster_cli"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(supervisor, signal.SIGTERM)
    left = _wait_gone(state, STOP_TIMEOUT_S)
    if left:
        if supervisor and _is_ours(supervisor, "devcluster_cli"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(supervisor, signal.SIGKILL)
        for component in state.get("components", []):
            if _group_members(component["pid"]):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(component["pid"], signal.SIGKILL)
        left = _wait_gone(state, 5.0)
    return left


def _print_usage(name: str, state: dict) -> None:
    kubeconfig = state["kubeconfig"]
    try:
        kubectl = str(tool_path("kubectl"))
    except MissingTool:
        kubectl = "kubectl"
    print(f"kubeconfig: {kubeconfig}")
    print("use it with:")
    print(f"  export KUBECONFIG={kubeconfig}")
    print(f"  {kubectl} --kubeconfig {kubeconfig} get ns")
    print(f"stop it with: rlfleet dev-cluster down --name {name}")


# ---- the supervisor ------------------------------------------------------------------------------

class _Terminate(BaseException):
    """Raised by the signal handler to unwind whatever the supervisor is doing."""


def serve(args: argparse.Namespace) -> int:
    """Run the control plane until SIGTERM/SIGINT/SIGHUP; stop every child on the way out."""
    from rlfleet.devcluster import ControlPlane

    def terminate(signum, frame):
        raise _Terminate(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, terminate)
    directory = args.dir
    base = {"name": args.name, "supervisor_pid": os.getpid(), "directory": str(directory)}
    write_state(directory, {**base, "status": "starting"})
    plane = ControlPlane(directory, keep=True)
    status, error, code = "stopped", None, 0
    try:
        plane.start(timeout=args.timeout)
        base.update(server=plane.server, kubeconfig=str(plane.kubeconfig),
                    components=[vars(c) for c in plane.components()])
        write_state(directory, {**base, "status": "ready"})
        print(f"ready: {plane.server}", flush=True)
        while (failed := plane.failed_component()) is None:
            time.sleep(1.0)
        tail = " | ".join(failed.tail(5))
        status, error, code = "failed", f"{failed.name} exited with code {failed.returncode}: {tail}", 1
    except _Terminate as why:
        print(f"stopping on {why}", flush=True)
    except Exception as exc:  # start-up failures: record them for `up` to print
        status, error, code = "failed", str(exc), 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # finish the clean-up whatever arrives now
        base.setdefault("components", [vars(c) for c in plane.components()])
        plane.stop(keep=True)
        write_state(directory, {**base, "status": status, **({"error": error} if error else {})})
        print(f"{status}" + (f": {error}" if error else ""), flush=True)
    return code


# ---- argument parsing ----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet dev-cluster",
                                     description="A local Kubernetes control plane on loopback (no Docker).")
    sub = parser.add_subparsers(dest="action", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--name", default=DEFAULT_NAME, help="cluster name (default: %(default)s)")
        p.add_argument("--dir", type=Path, default=None,
                       help="state and data directory (default: ~/.cache/rlfleet/clusters/NAME)")

    up = sub.add_parser("up", help="start a cluster in the background and print how to use it")
    common(up)
    up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for readiness")
    down = sub.add_parser("down", help="stop a cluster; no process is left")
    common(down)
    down.add_argument("--keep", action="store_true", help="keep the data directory")
    status = sub.add_parser("status", help="say whether a cluster runs, and where")
    common(status)
    serve_parser = sub.add_parser("_serve", help=argparse.SUPPRESS)
    common(serve_parser)
    serve_parser.add_argument("--timeout", type=float, default=120.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.name or "/" in args.name or args.name.startswith("."):
        print(f"error: invalid cluster name {args.name!r}", file=sys.stderr)
        return 2
    args.dir = (args.dir or default_dir(args.name)).expanduser().absolute()
    handlers = {"up": cmd_up, "down": cmd_down, "status": cmd_status, "_serve": serve}
    return handlers[args.action](args)


if __name__ == "__main__":
    raise SystemExit(main())
