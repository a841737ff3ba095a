"""Helpers of the end-to-end tests: the chart, the node agent and the operator as local processes.

Everything real: the Helm chart installed with the pinned helm into the test control plane, the node
agent running pods as local process groups, the operator running with its own ServiceAccount token.
"""
from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rlfleet.devcluster.node import node_agent_argv, node_is_ready
from rlfleet.util.binaries import tool_path
from rlfleet.util.ports import free_port
from rlfleet.util.procs import GroupProcess, kill_pod_process_groups

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rlfleet"
SYSTEM_NS = "rlfleet-system"
OPERATOR_SA = "rlfleet-operator"


def wait_for(check: Callable[[], Any], *, timeout: float, interval: float = 1.0, what: str = "condition",
             context: Callable[[], str] | None = None) -> Any:
    """Poll check() until it returns something truthy; fail with what was last seen."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    extra = f"\n{context()}" if context else ""
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; last seen: {last!r}{extra}")


def get_json(cp, *args: str, namespace: str | None = None) -> dict | None:
    ns = ["-n", namespace] if namespace else []
    result = cp.kubectl("get", *args, *ns, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def apply(cp, obj: dict | list[dict]) -> None:
    docs = obj if isinstance(obj, list) else [obj]
    cp.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(d) for d in docs))


def helm(cp, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    argv = [str(tool_path("helm")), f"--kubeconfig={cp.kubeconfig}", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=True)


@contextlib.contextmanager
def chart_installed(cp, namespace: str):
    """The chart installed for one watched namespace, its operator Deployment at zero replicas (tests run
    the operator as a local process with the chart's ServiceAccount token); uninstalled afterwards."""
    cp.kubectl("create", "namespace", namespace, check=False)
    helm(cp, "upgrade", "--install", "rlfleet", str(CHART), "-n", SYSTEM_NS, "--create-namespace",
         "--set", f"watchNamespaces={{{namespace}}}", "--set", "operator.replicas=0")
    try:
        yield
    finally:
        helm(cp, "uninstall", "rlfleet", "-n", SYSTEM_NS)


@contextlib.contextmanager
def chart_operator(cp, namespace: str, log_dir: Path):
    """The operator as a local process with the chart's ServiceAccount token (the chart installed for
    `namespace` first), started; stopped afterwards."""
    op = OperatorProcess(cp.service_account_kubeconfig(SYSTEM_NS, OPERATOR_SA), namespace, log_dir)
    op.start()
    try:
        yield op
    finally:
        op.stop()


def start_node_agent(cp, data_dir: Path, *, first_host: int = 100,
                     env: dict[str, str] | None = None) -> GroupProcess:
    """The node agent as a process (its environment: this one's plus `env`)."""
    argv = node_agent_argv(python=sys.executable, kubeconfig=cp.kubeconfig, node="local-node", data_dir=data_dir,
                           first_host=first_host)
    agent = GroupProcess("node-agent", argv, log_path=data_dir / "node-agent.log", env=env)
    agent.start()
    wait_for(lambda: _node_ready(cp), timeout=60, what="the node to be Ready",
             context=lambda: "\n".join(agent.tail(40)))
    return agent


def stop_node_agent(agent: GroupProcess, data_dir: Path) -> int:
    """Stop the agent (it stops its pods); kill any pod process group it left. Returns how many it left."""
    agent.stop(grace_s=30.0)
    return kill_pod_process_groups(data_dir)


def _node_ready(cp) -> bool:
    return node_is_ready(get_json(cp, "node", "local-node"))


class OperatorProcess:
    """`python -m rlfleet.operator` with the chart's ServiceAccount token, restartable."""

    def __init__(self, kubeconfig: Path, namespace: str, log_dir: Path, extra_args: tuple[str, ...] = (),
                 python: str = sys.executable, env: dict[str, str] | None = None):
        """`python` and `env`: another interpreter (e.g. the operator's own environment) and what it needs."""
        self.kubeconfig, self.namespace, self.log_dir = kubeconfig, namespace, log_dir
        self.extra_args = tuple(extra_args)
        self.python, self.env = python, env
        self.liveness_port = free_port()
        self.metrics_port = free_port()
        self.process: GroupProcess | None = None
        self.starts = 0

    def start(self, *peering: str) -> None:
        """Start (stopping a running one first); `peering` replaces --standalone, e.g. ("--peering", "rlfleet")."""
        self.stop()
        self.starts += 1
        self.process = GroupProcess("operator", [
            self.python, "-P", "-m", "rlfleet.operator", "--kubeconfig", str(self.kubeconfig),
            "--namespace", self.namespace, *(peering or ("--standalone",)),
            "--liveness", f"http://127.0.0.1:{self.liveness_port}/healthz",
            "--metrics-host", "127.0.0.1", "--metrics-port", str(self.metrics_port), *self.extra_args,
        ], log_path=self.log_dir / f"operator-{self.starts}.log", env=self.env)
        self.process.start()
        wait_for(self.alive, timeout=60, interval=0.5, what="the operator's liveness endpoint", context=self.tail)

    def stop(self) -> None:
        if self.process:
            self.process.stop(grace_s=30.0)

    def alive(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()

    def tail(self) -> str:
        return "\n".join(self.process.tail(40)) if self.process else ""


def engine_pgid(pod_ip: str) -> int | None:
    """The process group of the SGLang engine bound to pod_ip (found in /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [w.decode(errors="replace") for w in argv]
        if "sglang.launch_server" in words and pod_ip in words:
            with contextlib.suppress(ProcessLookupError):
                return os.getpgid(int(entry))
    return None


def pod_pids(pod: str, namespace: str) -> list[int]:
    """Every process the node agent runs for a pod (its environment names the pod and its namespace)."""
    from rlfleet.crds.managed import ReservedEnv

    wanted = {f"{ReservedEnv.POD_NAME}={pod}".encode(), f"{ReservedEnv.POD_NAMESPACE}={namespace}".encode()}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = set(Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"))
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if wanted <= environ:
            found.append(int(entry))
    return found


@contextlib.contextmanager
def pod_held(pod: str, namespace: str) -> Iterator[list[int]]:
    """A pod's processes stopped (SIGSTOP) inside the block and let go after it, whatever it raises: an event
    lands between two known steps of a trainer, however fast its steps are."""
    pids = pod_pids(pod, namespace)
    assert pids, f"no process of pod {namespace}/{pod}"
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    try:
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def http_json(url: str, timeout: float = 30, *, api_key: str | None = None) -> dict:
    """GET url; with `api_key`, as the fleet's clients do (engines and routers answer 401 without it)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
        return json.loads(r.read())


def fleet_api_key(cp, fleet: str, namespace: str) -> str:
    """The key in the fleet's Secret `<fleet>-api-key` (read as the admin: the operator cannot)."""
    from rlfleet.crds.conventions import API_KEY_SECRET_KEY, api_key_secret_name

    secret = get_json(cp, "secret", api_key_secret_name(fleet), namespace=namespace)
    assert secret is not None, f"no Secret {api_key_secret_name(fleet)}"
    return base64.b64decode(secret["data"][API_KEY_SECRET_KEY]).decode()


RLFLEET_KINDS = ("trainingruns.rlfleet.io", "rolloutfleets.rlfleet.io", "evalfleets.rlfleet.io")
WORKLOAD_PODS = "app.kubernetes.io/component in (engine,router,trainer)"


def clear_rlfleet_objects(cp, *, timeout: float = 120) -> None:
    """Delete every TrainingRun, RolloutFleet and EvalFleet left in the cluster, and their pods.

    Every node agent of the session registers the same node, so a pod a module left Pending is started
    by the next module's agent: real engines of runs nobody watches, each ~1.6 GB. Their operator may be
    gone (a chart uninstalled), so the objects lose their finalizers first; the garbage collector then
    takes what they own, and pods a stopped agent can no longer confirm are removed at once.
    """
    for kind in RLFLEET_KINDS:
        for obj in (get_json(cp, kind, "-A") or {}).get("items", []):
            meta = obj["metadata"]
            where = (kind, meta["name"], "-n", meta["namespace"])
            if meta.get("finalizers"):
                cp.kubectl("patch", *where, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False)
            cp.kubectl("delete", *where, "--wait=false", check=False)

    def pods_left() -> list[str]:
        items = (get_json(cp, "pods", "-A", "-l", WORKLOAD_PODS) or {}).get("items", [])
        return [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in items]

    started = time.monotonic()
    while (left := pods_left()) and time.monotonic() - started < timeout:
        if time.monotonic() - started > 10:  # owners gone, but no agent left to confirm the pods' end
            cp.kubectl("delete", "pods", "-A", "-l", WORKLOAD_PODS, "--grace-period=0", "--force", "--wait=false",
                       check=False)
        time.sleep(1)
    assert not left, f"pods of rlfleet objects outlived their module: {left}"
