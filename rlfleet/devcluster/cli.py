"""`rlfleet dev-cluster up|down|status`: a local Kubernetes cluster that outlives the command.

`up` starts a detached supervisor process (`_serve`) that runs the control plane (rlfleet.devcluster.control_plane)
and, once the API server is ready, the node agent (rlfleet.devcluster.node; unless --no-node-agent), and
records its state, including every PID, in <dir>/state.json; `up` returns once the Node is Ready (the
API server, with --no-node-agent). `down` sends the supervisor SIGTERM (it stops the node agent, which
stops its pods, then the control plane), then makes sure that no recorded process and no pod process is
left, and removes the directory unless --keep.
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

from rlfleet.devcluster.node import DEFAULT_NODE, node_name_error
from rlfleet.util.binaries import CACHE_DIR, MissingTool, tool_path
from rlfleet.util.procs import group_pids, pod_process_groups, tail_file

DEFAULT_NAME = "dev"
# The supervisor runs this module; its command line is how `down` knows a recorded PID is still ours.
SUPERVISOR_MODULE = "rlfleet.devcluster.cli"
STATE_FILE = "state.json"
SUPERVISOR_LOG = "supervisor.log"
# The supervisor's own stop is bounded: node agent (devnode.STOP_GRACE_S) + three components (10 s each).
STOP_TIMEOUT_S = 90.0
NODE_DATA_DIR = "node"


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


def _pod_groups(state: dict) -> set[int]:
    """Process groups of the node agent's pods still running (they run in sessions of their own)."""
    node = state.get("node")
    return pod_process_groups(Path(node["data_dir"])) if node else set()


class _StopTargets:
    """What a stop must see gone, fixed when the stop begins.

    Recognised once, by command line (the supervisor) and by the files a pod writes (its process
    group), and then followed by pid and group in /proc: a process that is exiting has already given
    up its command line and its files but is not a zombie yet, and `down` must not return before it is.
    """

    def __init__(self, state: dict) -> None:
        self.state = state
        supervisor = state.get("supervisor_pid")
        self.supervisor = supervisor if supervisor and _is_ours(supervisor, SUPERVISOR_MODULE) else None
        self.groups = {c["pid"]: c["name"] for c in state.get("components", [])}
        self.groups.update({pgid: "pod process" for pgid in _pod_groups(state) if pgid not in self.groups})

    def leftovers(self) -> list[str]:
        """Processes still alive: the supervisor, each component's whole process group, the pods'."""
        left = []
        if self.supervisor and process_alive(self.supervisor):
            left.append(f"supervisor pid {self.supervisor}")
        for pgid in _pod_groups(self.state) - self.groups.keys():  # a pod started while stopping
            self.groups[pgid] = "pod process"
        for pgid, name in self.groups.items():
            left.extend(f"{name} pid {pid}" for pid in group_pids(pgid))
        return left

    def wait_gone(self, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left


# ---- commands ------------------------------------------------------------------------------------

def cmd_up(args: argparse.Namespace) -> int:
    if args.node_agent and (problem := node_name_error(args.node)):
        print(f"error: --node: {problem}", file=sys.stderr)
        return 2
    directory = args.dir
    state = read_state(directory)
    if state and process_alive(state.get("supervisor_pid")) and state.get("status") in ("starting", "ready"):
        if state["status"] == "starting":
            print(f"dev cluster {args.name!r} is starting ({directory}); see `rlfleet dev-cluster status`")
            return 0
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
    argv = [sys.executable, "-P", "-m", SUPERVISOR_MODULE, "_serve", "--name", args.name,
            "--dir", str(directory), "--timeout", str(args.timeout),
            "--node-agent" if args.node_agent else "--no-node-agent", "--node", args.node]
    if args.first_host is not None:
        argv += ["--first-host", str(args.first_host)]
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
    if state.get("node"):
        print(f"  node:       {state['node']['name']} (pod logs in {state['node']['data_dir']}/logs)")
    else:
        print("  node:       none (started with --no-node-agent)")
    supervisor = state.get("supervisor_pid")
    print(f"  supervisor: pid {supervisor} ({'alive' if process_alive(supervisor) else 'gone'})")
    for component in state.get("components", []):
        alive = "alive" if process_alive(component["pid"]) else "gone"
        print(f"  {component['name']}: pid {component['pid']} ({alive}), log {component['log']}")
    return 0 if running else 1


def _force_stop(state: dict) -> list[str]:
    """SIGTERM the supervisor and wait; then SIGKILL anything recorded that is still alive.

    Without a live supervisor nothing would stop the rest gracefully, so it is killed at once.
    """
    targets = _StopTargets(state)
    left = targets.leftovers()
    if targets.supervisor:
        with contextlib.suppress(ProcessLookupError):
            os.kill(targets.supervisor, signal.SIGTERM)
        left = targets.wait_gone(STOP_TIMEOUT_S)
    if left:
        if targets.supervisor:
            with contextlib.suppress(ProcessLookupError):
                os.kill(targets.supervisor, signal.SIGKILL)
        for pgid in targets.groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        left = targets.wait_gone(5.0)
    return left


def _print_usage(name: str, state: dict) -> None:
    kubeconfig = state["kubeconfig"]
    try:
        kubectl = str(tool_path("kubectl"))
    except MissingTool:
        kubectl = "kubectl"
    print(f"kubeconfig: {kubeconfig}")
    if state.get("node"):
        print(f"node: {state['node']['name']} (Ready; the node agent runs pods as local processes)")
    else:
        print("node: none (--no-node-agent): pods stay Pending until a node agent runs")
    print("use it with:")
    print(f"  export KUBECONFIG={kubeconfig}")
    print(f"  {kubectl} --kubeconfig {kubeconfig} get ns")
    print(f"stop it with: rlfleet dev-cluster down --name {name}")


# ---- the supervisor ------------------------------------------------------------------------------

class _Terminate(BaseException):
    """Raised by the signal handler to unwind whatever the supervisor is doing."""


def serve(args: argparse.Namespace) -> int:
    """Run the control plane and the node agent until SIGTERM/SIGINT/SIGHUP or a component exits.

    On the way out the node agent is stopped first (it stops its pods, while the API server still
    answers), then the control plane.
    """
    from rlfleet.devcluster.control_plane import ControlPlane
    from rlfleet.devcluster.node import DevNode

    def terminate(signum, frame):
        raise _Terminate(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, terminate)
    directory = args.dir
    base: dict = {"name": args.name, "supervisor_pid": os.getpid(), "directory": str(directory)}
    plane = ControlPlane(directory, keep=True)
    node = None
    if args.node_agent:
        node = DevNode(plane, args.node, directory / NODE_DATA_DIR, first_host=args.first_host)
        base["node"] = {"name": node.node, "data_dir": str(node.data_dir)}
    write_state(directory, {**base, "status": "starting"})

    def components() -> list[dict]:
        listed = [vars(c) for c in plane.components()]
        agent = node.component() if node else None
        return listed + ([vars(agent)] if agent else [])

    status, error, code = "stopped", None, 0
    try:
        deadline = time.monotonic() + args.timeout
        plane.start(timeout=args.timeout)
        base.update(server=plane.server, kubeconfig=str(plane.kubeconfig))
        if node:
            write_state(directory, {**base, "status": "starting", "components": components()})
            node.start(deadline)
        base["components"] = components()
        write_state(directory, {**base, "status": "ready"})
        print(f"ready: {plane.server}" + (f", node {node.node}" if node else ""), flush=True)
        while (failed := plane.failed_component() or (node.exited() if node else None)) is None:
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
        base.setdefault("components", components())
        if node:
            with contextlib.suppress(Exception):
                if left := node.stop():
                    print(f"killed {left} pod process group(s) the node agent left", flush=True)
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

    def node_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--node-agent", action=argparse.BooleanOptionalAction, default=True,
                       help="start the node agent, which runs pods as local processes (default: on)")
        p.add_argument("--node", default=DEFAULT_NODE, metavar="NAME",
                       help="name of the Node the agent registers (default: %(default)s)")
        p.add_argument("--first-host", type=int, default=None, metavar="N",
                       help="first pod address 127.0.0.N the agent hands out (default: the agent's)")

    up = sub.add_parser("up", help="start a cluster in the background and print how to use it")
    common(up)
    up.add_argument("--timeout", type=float, default=120.0,
                    help="seconds to wait for readiness (API server and Node)")
    node_options(up)
    down = sub.add_parser("down", help="stop a cluster; no process is left")
    common(down)
    down.add_argument("--keep", action="store_true", help="keep the data directory")
    status = sub.add_parser("status", help="say whether a cluster runs, and where")
    common(status)
    serve_parser = sub.add_parser("_serve", help=argparse.SUPPRESS)
    common(serve_parser)
    serve_parser.add_argument("--timeout", type=float, default=120.0)
    node_options(serve_parser)
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
