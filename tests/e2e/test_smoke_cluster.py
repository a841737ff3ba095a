"""Smoke tests: the local control plane is a real Kubernetes API server with RBAC and garbage collection,
and `rlfleet dev-cluster` starts one that runs pods (its node agent) and stops it without leaving a
process behind."""
from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from helpers.cluster import get_json, start_node_agent, stop_node_agent, wait_for
from rlfleet.devcluster.control_plane import ControlPlane
from rlfleet.util.binaries import tool_path
from rlfleet.util.procs import pod_process_groups

pytestmark = pytest.mark.cluster

CONFIGMAP = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: smoke
  namespace: {namespace}
data:
  greeting: hello
"""


def _namespace(plane: ControlPlane, name: str) -> str:
    plane.kubectl("create", "namespace", name)
    return name


def test_apiserver_readyz(control_plane: ControlPlane) -> None:
    pki = control_plane.pki
    context = ssl.create_default_context(cafile=str(pki.ca_cert))
    context.load_cert_chain(str(pki.admin_cert), str(pki.admin_key))
    with urllib.request.urlopen(f"{control_plane.server}/readyz?verbose", timeout=10, context=context) as response:
        body = response.read().decode()
    assert response.status == 200
    assert "readyz check passed" in body
    version = json.loads(control_plane.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == "v1.35.4"


def test_kubectl_apply_round_trip(control_plane: ControlPlane) -> None:
    namespace = _namespace(control_plane, "smoke-apply")
    applied = control_plane.kubectl("apply", "-f", "-", input=CONFIGMAP.format(namespace=namespace))
    assert "configmap/smoke created" in applied.stdout
    read = json.loads(control_plane.kubectl("get", "configmap", "smoke", "-n", namespace, "-o", "json").stdout)
    assert read["data"] == {"greeting": "hello"}
    again = control_plane.kubectl("apply", "-f", "-", input=CONFIGMAP.format(namespace=namespace))
    assert "configmap/smoke unchanged" in again.stdout


def test_unprivileged_service_account_is_forbidden(control_plane: ControlPlane) -> None:
    kubeconfig = control_plane.service_account_kubeconfig("smoke-rbac", "nobody")
    whoami = control_plane.kubectl("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}",
                                   kubeconfig=kubeconfig)
    assert whoami.stdout == "system:serviceaccount:smoke-rbac:nobody"
    denied = control_plane.kubectl("get", "secrets", "-n", "smoke-rbac", kubeconfig=kubeconfig, check=False)
    assert denied.returncode != 0
    assert "Forbidden" in denied.stderr and "cannot list resource \"secrets\"" in denied.stderr
    # The same request as admin succeeds: the denial is RBAC, not a broken connection.
    assert control_plane.kubectl("get", "secrets", "-n", "smoke-rbac").returncode == 0


def test_garbage_collector_deletes_dependents(control_plane: ControlPlane) -> None:
    namespace = _namespace(control_plane, "smoke-gc")
    owner_uid = control_plane.kubectl("create", "configmap", "owner", "-n", namespace,
                                      "-o", "jsonpath={.metadata.uid}").stdout
    control_plane.kubectl("apply", "-f", "-", input=f"""\
apiVersion: v1
kind: ConfigMap
metadata:
  name: dependent
  namespace: {namespace}
  ownerReferences: [{{apiVersion: v1, kind: ConfigMap, name: owner, uid: "{owner_uid}"}}]
""")
    control_plane.kubectl("delete", "configmap", "owner", "-n", namespace)
    deadline = time.monotonic() + 60
    while control_plane.kubectl("get", "configmap", "dependent", "-n", namespace, check=False).returncode == 0:
        assert time.monotonic() < deadline, "kube-controller-manager never garbage-collected the dependent"
        time.sleep(0.5)


def _run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "rlfleet.cli", "dev-cluster", *args],
                          capture_output=True, text=True, timeout=timeout)


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat[stat.rindex(")") + 2] != "Z":
            alive.append(pid)
    return alive


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that name text (the cluster's directory is in every one of them)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _pids_alive([int(entry)]):
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(f"{entry}: {cmdline[:200]}")
    return found


# Images containing "rlfleet" map `rlfleet` and `python` to this installation (rlfleet/devcluster/node_agent/plan.py).
DEV_PODS = """\
apiVersion: v1
kind: Pod
metadata: {name: once}
spec:
  restartPolicy: Never
  containers:
  - {name: main, image: ghcr.io/example/rlfleet:dev, command: [rlfleet, validate, --help]}
---
apiVersion: v1
kind: Pod
metadata: {name: sleeper}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 5
  containers:
  - name: main
    image: ghcr.io/example/rlfleet:dev
    command: [python, -c, "import time; print('sleeping', flush=True); time.sleep(120)"]
"""
FIRST_HOST = 240


def test_dev_cluster_up_runs_pods_and_down_leaves_no_process(tmp_path: Path) -> None:
    directory = tmp_path / "cluster"
    name = f"smoke-{os.getpid()}"
    pids: list[int] = []
    up = _run_cli("up", "--name", name, "--dir", str(directory), "--first-host", str(FIRST_HOST))
    try:
        assert up.returncode == 0, up.stderr + up.stdout
        match = re.search(r"^\s*export KUBECONFIG=(\S+)$", up.stdout, re.MULTILINE)
        assert match, f"`up` did not print the kubeconfig: {up.stdout}"
        kubeconfig = match.group(1)
        assert f"--kubeconfig {kubeconfig} get ns" in up.stdout

        def kubectl(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
            return subprocess.run([str(tool_path("kubectl")), "--kubeconfig", kubeconfig, *args], input=stdin,
                                  capture_output=True, text=True, timeout=60)

        namespaces = kubectl("get", "ns")
        assert namespaces.returncode == 0, namespaces.stderr
        assert re.search(r"^kube-system\s+Active", namespaces.stdout, re.MULTILINE)
        # `up` returned with the Node already Ready: no wait here.
        nodes = kubectl("get", "nodes")
        assert re.search(r"^local\s+Ready\s", nodes.stdout, re.MULTILINE), nodes.stdout + nodes.stderr

        status = _run_cli("status", "--name", name, "--dir", str(directory))
        assert status.returncode == 0 and "running" in status.stdout
        assert re.search(r"^\s+node-agent: pid \d+ \(alive\)", status.stdout, re.MULTILINE), status.stdout
        state = json.loads((directory / "state.json").read_text())
        pids = [state["supervisor_pid"]] + [c["pid"] for c in state["components"]]
        assert sorted(c["name"] for c in state["components"]) == [
            "etcd", "kube-apiserver", "kube-controller-manager", "node-agent"]
        assert len(_pids_alive(pids)) == 5

        # The namespace's default ServiceAccount (which admission requires) comes from a controller.
        wait_for(lambda: kubectl("apply", "-f", "-", stdin=DEV_PODS).returncode == 0, timeout=30, interval=0.5,
                 what="the pods to be admitted", context=lambda: kubectl("apply", "-f", "-", stdin=DEV_PODS).stderr)

        def pod(pod_name: str) -> dict:
            return json.loads(kubectl("get", "pod", pod_name, "-o", "json").stdout or "{}")

        def agent_log() -> str:
            return "\n".join(Path(c["log"]).read_text()[-3000:] for c in state["components"]
                             if c["name"] == "node-agent")

        once = wait_for(lambda: (p := pod("once")).get("status", {}).get("phase") in ("Succeeded", "Failed") and p,
                        timeout=30, interval=0.5, what="pod `once` to finish", context=agent_log)
        assert once["status"]["phase"] == "Succeeded", once["status"]
        assert once["spec"]["nodeName"] == "local"
        terminated = once["status"]["containerStatuses"][0]["state"]["terminated"]
        assert terminated["exitCode"] == 0 and "usage: rlfleet validate" in terminated["message"]
        sleeper = wait_for(lambda: (p := pod("sleeper")).get("status", {}).get("phase") == "Running" and p,
                           timeout=30, interval=0.5, what="pod `sleeper` to run", context=agent_log)
        # --first-host reached the agent: pods get 127.0.0.240 and up.
        assert {once["status"]["podIP"], sleeper["status"]["podIP"]} == {
            f"127.0.0.{FIRST_HOST}", f"127.0.0.{FIRST_HOST + 1}"}
        pod_groups = pod_process_groups(directory / "node")
        assert len(pod_groups) == 1, f"expected the sleeper's process group only: {pod_groups}"
        # `kubectl logs` reaches the agent's log endpoint (the API server has its kubelet client cert).
        logs = wait_for(lambda: kubectl("logs", "sleeper").stdout, timeout=10, interval=0.5,
                        what="`kubectl logs sleeper`", context=lambda: kubectl("logs", "sleeper").stderr)
        assert logs == "sleeping\n"
        pids += sorted(pod_groups)
    finally:
        down = _run_cli("down", "--name", name, "--dir", str(directory))
    assert down.returncode == 0, down.stderr + down.stdout
    assert _pids_alive(pids) == []  # supervisor, control plane, node agent, and the sleeper pod
    assert _processes_mentioning(str(directory)) == []
    assert not directory.exists()
    after = _run_cli("status", "--name", name, "--dir", str(directory))
    assert after.returncode != 0 and "not running" in after.stdout


OWNER_SCRIPT = """
import sys, time
from pathlib import Path
from rlfleet.devcluster.control_plane import ControlPlane
plane = ControlPlane(Path(sys.argv[1])).start()
print(" ".join(str(c.pid) for c in plane.components()), flush=True)
time.sleep(600)
"""


def test_killed_owner_leaves_no_control_plane_process(tmp_path: Path) -> None:
    # A test run killed by a timeout must not leave etcd or an API server behind.
    owner = subprocess.Popen([sys.executable, "-P", "-c", OWNER_SCRIPT, str(tmp_path / "plane")],
                             stdout=subprocess.PIPE, text=True)
    try:
        line = owner.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 3, f"the control plane did not start: {line!r}"
        assert len(_pids_alive(pids)) == 3
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 10
    while _pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _pids_alive(pids) == []


# `kubectl logs` through the node agent's log endpoint ----------------------------------------------------
LOGS_NS = "smoke-logs"
COUNTER = "for i in range(5): print(f'line {i}', flush=True)"
# Prints `ready`, waits (at most 30 s) for the file named by its argument, then ticks every 0.5 s for 3 s.
TICKER = """
import os, sys, time
print('ready', flush=True)
deadline = time.monotonic() + 30
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
for i in range(6):
    print(f'tick {i}', flush=True)
    time.sleep(0.5)
"""


def _log_pods(go_file: Path) -> str:
    pods = [
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": LOGS_NS},
         "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 2,
                  "containers": [{"name": "main", "image": "ghcr.io/example/rlfleet:dev",
                                  "command": ["python", "-c", script, *args]}]}}
        for name, script, args in (("counter", COUNTER, []), ("ticker", TICKER, [str(go_file)]))]
    return "\n---\n".join(json.dumps(p) for p in pods)


@pytest.fixture(scope="module")
def logs_node(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory):
    data_dir = tmp_path_factory.mktemp("logs-node")
    agent = start_node_agent(control_plane, data_dir, first_host=200)
    yield agent
    left = stop_node_agent(agent, data_dir)
    assert left == 0, f"the node agent left {left} pod process group(s) running"


def _get(url: str, context: ssl.SSLContext) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10, context=context) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_kubectl_logs_tail_follow_and_only_the_cluster_ca_may_read(control_plane: ControlPlane, logs_node,
                                                                  tmp_path: Path) -> None:
    cp = control_plane
    go_file = tmp_path / "go"
    cp.kubectl("create", "namespace", LOGS_NS)
    # The namespace's default ServiceAccount (which admission requires) comes from a controller.
    wait_for(lambda: cp.kubectl("apply", "-f", "-", input=_log_pods(go_file), check=False).returncode == 0,
             timeout=30, interval=0.5, what="the pods to be admitted")

    def phase(name: str) -> str:
        return (get_json(cp, "pod", name, namespace=LOGS_NS) or {}).get("status", {}).get("phase", "")

    def logs(*args: str) -> subprocess.CompletedProcess:
        return cp.kubectl("logs", "-n", LOGS_NS, *args, check=False)

    wait_for(lambda: phase("counter") == "Succeeded", timeout=30, interval=0.3, what="pod counter to succeed",
             context=logs_node.tail)
    whole = logs("counter")
    assert whole.returncode == 0, whole.stderr
    assert whole.stdout == "".join(f"line {i}\n" for i in range(5))
    assert logs("counter", "--tail", "2").stdout == "line 3\nline 4\n"
    assert logs("counter", "-c", "main", "--tail", "0").stdout == ""
    unknown = logs("counter", "-c", "nope")
    assert unknown.returncode != 0 and "nope" in unknown.stderr, unknown.stderr
    previous = logs("counter", "--previous")
    assert previous.returncode != 0 and "previous=true is not supported" in previous.stderr, previous.stderr

    # -f streams while the container runs and ends by itself when the container ends.
    wait_for(lambda: phase("ticker") == "Running", timeout=30, interval=0.3, what="pod ticker to run",
             context=logs_node.tail)
    follower = subprocess.Popen([str(tool_path("kubectl")), f"--kubeconfig={cp.kubeconfig}", "logs", "-f",
                                 "-n", LOGS_NS, "ticker"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert follower.stdout.readline() == "ready\n"
        assert follower.poll() is None, "kubectl logs -f ended while the container still ran"
        go_file.touch()
        rest, errors = follower.communicate(timeout=30)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert follower.returncode == 0, errors
    assert rest == "".join(f"tick {i}\n" for i in range(6))
    # It ended: the stream closed with the container, and the pod (restartPolicy Never) succeeds.
    wait_for(lambda: phase("ticker") == "Succeeded", timeout=30, interval=0.3, what="pod ticker to succeed",
             context=logs_node.tail)

    # Straight to the agent: a client certificate of the cluster CA is required.
    node = get_json(cp, "node", "local-node")
    port = node["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"]
    assert {"type": "InternalIP", "address": "127.0.0.1"} in node["status"]["addresses"]
    url = f"https://127.0.0.1:{port}/containerLogs/{LOGS_NS}/counter"
    anonymous = ssl.create_default_context()
    anonymous.check_hostname, anonymous.verify_mode = False, ssl.CERT_NONE  # its serving cert is self-signed
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        _get(f"{url}/main", anonymous)
    with_ca_cert = ssl.create_default_context()
    with_ca_cert.check_hostname, with_ca_cert.verify_mode = False, ssl.CERT_NONE
    with_ca_cert.load_cert_chain(str(cp.pki.kubelet_client_cert), str(cp.pki.kubelet_client_key))
    assert _get(f"{url}/main?tailLines=1", with_ca_cert) == (200, "line 4\n")
    status, body = _get(f"{url}/nope", with_ca_cert)
    assert status == 404 and "container 'nope' is not in pod" in body
    status, body = _get(f"https://127.0.0.1:{port}/containerLogs/{LOGS_NS}/ghost/main", with_ca_cert)
    assert status == 404 and "is not on node local-node" in body
