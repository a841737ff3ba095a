"""Smoke tests: the local control plane is a real Kubernetes API server with RBAC and garbage collection,
and `rlfleet dev-cluster` starts and stops one without leaving a process behind."""
from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rlfleet.devcluster import ControlPlane
from rlfleet.tools import tool_path

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
    whoami = control_plane.kubectl("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}", kubeconfig=kubeconfig)
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


def test_dev_cluster_up_get_ns_down(tmp_path: Path) -> None:
    directory = tmp_path / "cluster"
    name = f"smoke-{os.getpid()}"
    pids: list[int] = []
    up = _run_cli("up", "--name", name, "--dir", str(directory))
    try:
        assert up.returncode == 0, up.stderr + up.stdout
        match = re.search(r"^\s*export KUBECONFIG=(\S+)$", up.stdout, re.MULTILINE)
        assert match, f"`up` did not print the kubeconfig: {up.stdout}"
        kubeconfig = match.group(1)
        assert f"--kubeconfig {kubeconfig} get ns" in up.stdout

        namespaces = subprocess.run([str(tool_path("kubectl")), "--kubeconfig", kubeconfig, "get", "ns"],
                                    capture_output=True, text=True, timeout=60)
        assert namespaces.returncode == 0, namespaces.stderr
        assert re.search(r"^kube-system\s+Active", namespaces.stdout, re.MULTILINE)

        status = _run_cli("status", "--name", name, "--dir", str(directory))
        assert status.returncode == 0 and "running" in status.stdout
        state = json.loads((directory / "state.json").read_text())
        pids = [state["supervisor_pid"]] + [c["pid"] for c in state["components"]]
        assert sorted(c["name"] for c in state["components"]) == ["etcd", "kube-apiserver", "kube-controller-manager"]
        assert len(_pids_alive(pids)) == 4
    finally:
        down = _run_cli("down", "--name", name, "--dir", str(directory))
    assert down.returncode == 0, down.stderr + down.stdout
    assert _pids_alive(pids) == []
    assert _processes_mentioning(str(directory)) == []
    assert not directory.exists()
    after = _run_cli("status", "--name", name, "--dir", str(directory))
    assert after.returncode != 0 and "not running" in after.stdout


OWNER_SCRIPT = """
import sys, time
from pathlib import Path
from rlfleet.devcluster import ControlPlane
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
