"""The dev cluster's node: the node agent (rlfleet.devcluster.node_agent.agent) run next to the control plane.

`rlfleet dev-cluster up` starts it once the API server is ready and returns when its Node is Ready, so
the cluster runs pods with no second command. Stopping it stops its pods first (the agent does so on
SIGTERM); any pod process group it still left is killed, found by its log files (`pod_process_groups`).
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

from rlfleet.devcluster.control_plane import ComponentState, ControlPlane, ControlPlaneError, failure_message
from rlfleet.util.procs import GroupProcess, kill_pod_process_groups

COMPONENT = "node-agent"
DEFAULT_NODE = "local"
POLL_S = 0.5
# The agent gives each pod up to node_agent.STOP_GRACE_CAP_S (30 s) to stop; then it exits itself.
STOP_GRACE_S = 40.0

# A Node name is a DNS-1123 subdomain (the API server rejects anything else).
_NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


# ---- pure pieces ---------------------------------------------------------------------------------

def node_name_error(name: str) -> str | None:
    """Why name cannot be a Node's name, or None when it can."""
    if len(name) > 253 or not _NODE_NAME.fullmatch(name):
        return (f"invalid node name {name!r}: use lower-case letters, digits, '-' and '.', "
                "starting and ending with a letter or digit (at most 253 characters)")
    return None


def node_agent_argv(*, python: str, kubeconfig: Path, node: str, data_dir: Path,
                    first_host: int | None = None) -> list[str]:
    """The command line of a node agent that also schedules (the local control plane has no scheduler)."""
    argv = [python, "-P", "-m", "rlfleet.devcluster.node_agent.agent", "--kubeconfig", str(kubeconfig),
            "--node", node, "--schedule", "--data-dir", str(data_dir)]
    if first_host is not None:
        argv += ["--first-host", str(first_host)]
    return argv


def node_is_ready(node: dict | None) -> bool:
    """True when a Node object's Ready condition is True."""
    conditions = ((node or {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


# ---- the process ---------------------------------------------------------------------------------

class DevNode:
    """One node agent process for a ControlPlane: `start(deadline)`, `stop()`."""

    def __init__(self, plane: ControlPlane, node: str, data_dir: Path, *, first_host: int | None = None):
        self.plane = plane
        self.node = node
        self.data_dir = Path(data_dir)
        self.first_host = first_host
        self.process: GroupProcess | None = None

    def start(self, deadline: float) -> None:
        """Start the agent and wait until its Node is Ready; ControlPlaneError (with its log) otherwise."""
        argv = node_agent_argv(python=sys.executable, kubeconfig=self.plane.kubeconfig, node=self.node,
                               data_dir=self.data_dir, first_host=self.first_host)
        self.process = GroupProcess(COMPONENT, argv, log_path=self.plane.data_dir / "logs" / f"{COMPONENT}.log",
                                    cwd=str(self.plane.data_dir))
        self.process.start()
        self._wait_ready(deadline)

    def _read_node(self) -> dict | None:
        result = self.plane.kubectl("get", "node", self.node, "-o", "json", check=False, timeout=10)
        return json.loads(result.stdout) if result.returncode == 0 else None

    def _wait_ready(self, deadline: float) -> None:
        assert self.process is not None
        while True:
            if self.process.returncode is not None:
                raise ControlPlaneError(failure_message(
                    self.process, f"exited with code {self.process.returncode} before node {self.node!r} was Ready"))
            if node_is_ready(self._read_node()):
                return
            if time.monotonic() >= deadline:
                raise ControlPlaneError(failure_message(self.process, f"did not make node {self.node!r} Ready in time"))
            time.sleep(POLL_S)

    def exited(self) -> GroupProcess | None:
        """The agent's process when it has exited (a failure: it runs until stopped), else None."""
        return self.process if self.process and self.process.returncode is not None else None

    def component(self) -> ComponentState | None:
        if self.process is None or self.process.pid is None:
            return None
        return ComponentState(COMPONENT, self.process.pid, str(self.process.log_path))

    def stop(self) -> int:
        """Stop the agent (it stops its pods), then kill any pod process group left; returns how many were left."""
        if self.process is not None:
            self.process.stop(grace_s=STOP_GRACE_S)
        return kill_pod_process_groups(self.data_dir)
